"""Metric sinks for raw training loops: where ``watch(..., sinks=[...])`` sends its numbers.

On every observed step (see ``every_n_steps``) the watcher calls
``sink.log_metrics(step, metrics)`` with ``grad_norm/<layer>``, ``grad_norm_total`` and
``findings``; at exit it calls ``sink.close()``. Adding an output means adding a sink,
never editing the watcher. A sink that raises is reported as an ``internal_error`` finding
and training goes on.

Example:
    >>> from gradwatch.sinks import CSVSink, TensorBoardSink
    >>> sinks = [TensorBoardSink("runs/exp1"), CSVSink("metrics.csv")]  # doctest: +SKIP
    >>> with gradwatch.watch(model, opt, sinks=sinks):  # doctest: +SKIP
    ...     train()
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gradwatch.sinks.csv import CSVSink
from gradwatch.sinks.tensorboard import TensorBoardSink

__all__ = ["CSVSink", "Sink", "TensorBoardSink"]


@runtime_checkable
class Sink(Protocol):
    """What the watcher calls on a sink."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of one observed optimizer step."""

    def close(self) -> None:
        """Flush and release resources (called once, when the watcher exits)."""
