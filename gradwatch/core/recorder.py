"""Per-layer statistics over observed steps, and the metrics fed to sinks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from gradwatch.checks.views import StepView
from gradwatch.core.layers import LayerTrack

__all__ = ["LayerRecorder"]


class LayerRecorder:
    """Keeps each layer's :class:`LayerTrack` and the latest metrics; feeds the sinks."""

    def __init__(self, history: int, sinks: Sequence[Any]) -> None:
        self.history = history
        self.sinks = list(sinks)
        self.tracks: dict[str, LayerTrack] = {}
        self.metrics: dict[str, float] = {}
        self._keys: dict[str, str] = {}

    def record(
        self,
        view: StepView,
        *,
        several_optimizers: bool,
        findings: int,
        guard: Callable[..., Any],
    ) -> None:
        """Fold one observed step into the layer tracks and send its metrics to the sinks."""
        total = 0.0
        metrics: dict[str, float] = {}
        tracks, keys, step = self.tracks, self._keys, view.step
        for layer, sample in view.layers.items():
            lt = tracks.get(layer)
            if lt is None:
                lt = tracks[layer] = LayerTrack(self.history)
                keys[layer] = f"grad_norm/{layer}"  # built once per layer, not per step
            lt.update(step, sample)
            norm = sample.norm
            total += norm * norm
            metrics[keys[layer]] = norm
        # With several optimizers each step sees its own layers: name the total per optimizer
        # so that sinks do not get two different values for one series at one step.
        key = (
            f"grad_norm_total/optimizer_{view.optimizer}"
            if several_optimizers
            else "grad_norm_total"
        )
        metrics[key] = total**0.5
        metrics["findings"] = float(findings)
        self.metrics = {**self.metrics, **metrics}
        for sink in self.sinks:
            guard("sink", sink.log_metrics, view.step, dict(metrics))

    def close_sinks(self, guard: Callable[..., Any]) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                guard("sink close", close)
