"""``CSVSink``: metrics as a long-format CSV file (``step,metric,value``), one row per value.

Long format keeps the file valid when metrics appear mid-run (a layer that first runs at
step 500), which a wide table with a fixed header cannot. Pivot it for plotting:
``pandas.read_csv(path).pivot(index="step", columns="metric", values="value")``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import IO, Optional, Union

from gradwatch.errors import ConfigError

__all__ = ["CSVSink"]

HEADER = ("step", "metric", "value")


def _cell(value: float) -> str:
    # repr() round-trips a float exactly; nan/inf/-inf are read back by float() and pandas.
    return repr(float(value)) if math.isfinite(value) else str(float(value))


class CSVSink:
    """Write every observed metric as a ``step,metric,value`` row.

    The file is truncated and the header written when the sink is created; rows are
    flushed after each observed step so a crashed run keeps what it logged.

    Args:
        path: the CSV file; missing parent folders are created.

    Example:
        >>> sink = CSVSink("gradwatch-metrics.csv")  # doctest: +SKIP
        >>> with gradwatch.watch(model, opt, sinks=[sink], config={"every_n_steps": 1}):  # doctest: +SKIP
        ...     train()
    """

    def __init__(self, path: Union[str, Path]) -> None:
        if not isinstance(path, (str, Path)):
            raise ConfigError(f"CSVSink needs a file path, got {type(path).__name__}")
        self.path = Path(path)
        if self.path.is_dir():
            raise ConfigError(f"CSVSink path '{self.path}' is a directory, not a file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A layer name with a lone surrogate (os.fsdecode) is written as its escape.
            self._fh: Optional[IO[str]] = self.path.open(
                "w", encoding="utf-8", errors="backslashreplace", newline=""
            )
        except OSError as exc:
            raise ConfigError(f"CSVSink cannot write '{self.path}': {exc.strerror}") from None
        self._writer = csv.writer(self._fh)
        self._writer.writerow(HEADER)
        self._fh.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row per metric of ``step``."""
        if self._fh is None:
            return  # closed: a late call must not raise into the training loop
        self._writer.writerows((int(step), name, _cell(v)) for name, v in metrics.items())
        self._fh.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> CSVSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
