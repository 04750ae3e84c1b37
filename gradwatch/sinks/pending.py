"""``PendingMetrics``: hold an observed step's metrics until a framework may log them.

The core feeds sinks from inside ``optimizer.step()``, where neither Lightning's
``LightningModule.log`` nor a Hugging Face ``Trainer.log`` belongs; the framework adapters
take the held values at their own logging point. With several optimizers one batch may bring
several observed steps: their layers merge and the total is recomputed over all of them.
A ghost layer has no gradient, hence no norm: :meth:`take` logs it as a flat 0, so the
series people plot shows the layer dead instead of missing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from gradwatch.checks.ghost import GhostParam

if TYPE_CHECKING:
    from gradwatch.core.watcher import Watcher

__all__ = ["PendingMetrics", "ghost_layers"]


def ghost_layers(watcher: Watcher) -> list[str]:
    """The layers flagged ``ghost_param`` so far."""
    return [f.module for f in watcher.findings(GhostParam.id) if f.module]


class PendingMetrics:
    """A gradwatch sink that keeps the latest observed metrics for an adapter to take.

    Example:
        >>> sink = PendingMetrics()
        >>> sink.log_metrics(0, {"grad_norm/fc": 3.0, "grad_norm/out": 4.0})
        >>> sink.take()["grad_norm_total"]
        5.0
    """

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Merge one observed step's metrics into the held ones."""
        self.metrics.update(metrics)
        layers = [v for k, v in self.metrics.items() if k.startswith("grad_norm/")]
        if layers:
            self.metrics["grad_norm_total"] = math.sqrt(sum(v * v for v in layers))

    def take(self, watcher: Optional[Watcher] = None) -> dict[str, float]:
        """Hand over (and forget) the held metrics; ghost layers of ``watcher`` as 0."""
        out, self.metrics = self.metrics, {}
        if out and watcher is not None:
            for layer in ghost_layers(watcher):
                out.setdefault(f"grad_norm/{layer}", 0.0)
        return out

    def close(self) -> None:
        """Drop what was not taken (the watcher exits)."""
        self.metrics = {}
