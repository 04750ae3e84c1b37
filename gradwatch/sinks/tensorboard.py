"""``TensorBoardSink``: metrics as TensorBoard scalars under ``gradwatch/<metric>``.

Needs the ``tensorboard`` package (``pip install gradwatch[tensorboard]``), imported only
when the sink creates its own ``SummaryWriter``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Union

from gradwatch.errors import ConfigError

__all__ = ["PREFIX", "TensorBoardSink"]

PREFIX = "gradwatch/"
_LAYER_NORM = "grad_norm/"


class _MissingExtraError(ConfigError, ImportError):
    """The ``tensorboard`` package is not installed."""


def _summary_writer(logdir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise _MissingExtraError(
            f"TensorBoardSink needs the tensorboard package ({exc}): "
            "pip install gradwatch[tensorboard]"
        ) from None
    return SummaryWriter(log_dir=logdir)


class TensorBoardSink:
    """Log each metric as a scalar: tag ``gradwatch/<metric>``, e.g. ``gradwatch/grad_norm/fc1``.

    Args:
        writer_or_logdir: a ``SummaryWriter`` (or anything with ``add_scalar``) that the
            caller owns and closes, or a log directory for a writer this sink owns.
        histograms: also log, per observed step, the distribution of the per-layer
            gradient norms as the histogram ``gradwatch/grad_norm_layers``.

    Example:
        >>> sink = TensorBoardSink("runs/exp1")  # doctest: +SKIP
        >>> with gradwatch.watch(model, opt, sinks=[sink]):  # doctest: +SKIP
        ...     train()
    """

    def __init__(self, writer_or_logdir: Union[Any, str, Path], histograms: bool = False) -> None:
        if isinstance(writer_or_logdir, (str, Path)):
            if Path(writer_or_logdir).is_file():
                raise ConfigError(f"TensorBoardSink log dir '{writer_or_logdir}' is a file")
            self.writer = _summary_writer(str(writer_or_logdir))
            self._owned = True
        elif callable(getattr(writer_or_logdir, "add_scalar", None)):
            self.writer = writer_or_logdir
            self._owned = False
        else:
            raise ConfigError(
                "TensorBoardSink needs a SummaryWriter or a log directory, "
                f"got {type(writer_or_logdir).__name__}"
            )
        if histograms and not callable(getattr(self.writer, "add_histogram", None)):
            raise ConfigError("TensorBoardSink(histograms=True) needs a writer with add_histogram")
        self.histograms = histograms
        self._closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Write every metric of ``step`` as a scalar (NaN/Inf included: they are the news)."""
        if self._closed:
            return
        for name, value in metrics.items():
            self.writer.add_scalar(PREFIX + name, float(value), global_step=int(step))
        if self.histograms:
            norms = [
                float(v)
                for k, v in metrics.items()
                if k.startswith(_LAYER_NORM) and math.isfinite(v)
            ]
            if norms:
                import torch

                self.writer.add_histogram(
                    PREFIX + "grad_norm_layers", torch.tensor(norms), global_step=int(step)
                )

    def close(self) -> None:
        """Close the writer this sink created; only flush one the caller passed in."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self.writer.close()
        elif callable(getattr(self.writer, "flush", None)):
            self.writer.flush()
