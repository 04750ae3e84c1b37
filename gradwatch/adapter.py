"""What the framework callbacks share: one watcher per run, its report, its metrics.

The Lightning and Hugging Face callbacks differ only in which framework events start and
end a run and where the report goes; the rest lives here, framework-free (this module
imports neither Lightning nor transformers).

Example:
    >>> adapter = WatchAdapter({"every_n_steps": 1}, print_summary=False)
    >>> adapter.config.every_n_steps, adapter.watcher is None
    (1, True)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from gradwatch.config import GradWatchConfig
from gradwatch.core.watcher import Watcher, watch
from gradwatch.report import Report
from gradwatch.sinks.pending import PendingMetrics

__all__ = ["WatchAdapter"]

T = TypeVar("T")


class WatchAdapter:
    """The state and the run lifecycle of a framework callback around :func:`watch`.

    Args:
        config: a :class:`~gradwatch.GradWatchConfig`, a dict of its fields, or a path to a
            YAML/TOML/JSON file (a bad one raises :class:`~gradwatch.ConfigError` here).
        print_summary: print the one-screen summary on the main process when the run ends.
        report_name: file name of the JSON report written when the run ends; ``None``
            writes none.
        log_metrics: collect ``gradwatch/...`` metrics on observed steps for the framework's
            loggers.

    Attributes:
        report: the :class:`~gradwatch.Report` of the last run; ``None`` before.
        watcher: the live :class:`~gradwatch.Watcher` during a run.
        report_path: where the last report was written, if it was.
    """

    #: Where warnings about writing the report go (each framework names its own logger).
    log: logging.Logger = logging.getLogger("gradwatch")

    def __init__(
        self,
        config: Union[str, dict[str, Any], GradWatchConfig, None] = None,
        *,
        print_summary: bool = True,
        report_name: Optional[str] = None,
        log_metrics: bool = True,
    ) -> None:
        self.config = GradWatchConfig.coerce(config)
        self.print_summary = print_summary
        self.report_name = report_name
        self.log_metrics = log_metrics
        self.report: Optional[Report] = None
        self.report_path: Optional[Path] = None
        self.watcher: Optional[Watcher] = None
        self._sink = PendingMetrics()

    def _start(
        self,
        model: torch.nn.Module,
        optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None],
        scaler: Any,
    ) -> Watcher:
        """Attach a fresh watcher (and a fresh metrics buffer) for this run."""
        self._sink = PendingMetrics()
        watcher = watch(
            model,
            optimizers,
            config=self.config,
            scaler=scaler,
            sinks=[self._sink] if self.log_metrics else (),
        )
        self.watcher = watcher.attach()
        return watcher

    def _stop(self) -> Optional[Watcher]:
        """Remove the hooks and keep the report; the closed watcher, or ``None`` if none ran."""
        watcher, self.watcher = self.watcher, None
        if watcher is None:
            return None
        watcher.close()
        self.report = watcher.report()
        return watcher

    def _write(self, folder: Path) -> None:
        """Write the report to ``folder / report_name``; a full disk only warns."""
        if not self.report_name or self.report is None:
            return
        try:
            self.report_path = self.report.write(folder / self.report_name)
        except OSError as exc:  # a full disk must not turn a finished run into a crash
            self.log.warning("gradwatch could not write its report: %s", exc)

    def _print(self) -> None:
        if self.report is not None and self.print_summary and not self.config.console:
            self.report.print()  # console=True: the core printed it already

    def _metrics(self) -> dict[str, float]:
        """This run's metrics since the last call, as ``gradwatch/<name>`` floats."""
        return {f"gradwatch/{k}": float(v) for k, v in self._sink.take(self.watcher).items()}

    @staticmethod
    def _guarded(
        watcher: Optional[Watcher], where: str, fn: Callable[..., T], *args: Any
    ) -> Optional[T]:
        """Run an adapter step; a failure is an ``internal_error`` finding, never a crash."""
        try:
            return fn(*args)
        except Exception as exc:
            if watcher is not None:
                watcher.record_fault(where, exc)
            return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fail_on={self.config.fail_on!r}, "
            f"every_n_steps={self.config.every_n_steps}, print_summary={self.print_summary})"
        )
