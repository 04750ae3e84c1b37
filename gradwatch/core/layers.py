"""Per-layer statistics: one observed step's aggregation, running tracks, the sinks' metrics.

:func:`folded_samples` is the usual step's fast path of
:func:`gradwatch.core.gather.layer_samples`: when every tracked parameter arrived, has a
finite gradient and was measured, the device folded the per-parameter values into per-layer
columns before the step's transfer (:mod:`gradwatch.measure.columns`), and the samples are
built from them in one C-level pass. :class:`LayerTrack` keeps what the report shows of a
layer; :class:`LayerRecorder` folds observed steps into them and feeds the sinks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import isnan
from operator import truediv
from typing import Any, Callable, Optional

from gradwatch.checks.views import LayerSample, StepView
from gradwatch.measure.columns import ROWS, Layout
from gradwatch.results import LayerStats


@dataclass
class LayerTrack:
    """What the report keeps about one layer, updated on observed steps."""

    history_len: int
    last: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    total: float = 0.0
    count: int = 0
    mean_abs: Optional[float] = None
    max_abs: Optional[float] = None
    zero_fraction: Optional[float] = None
    param_norm: Optional[float] = None
    update_ratio: Optional[float] = None
    history: deque[tuple[int, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.history_len)

    def update(self, step: int, s: LayerSample) -> None:
        n = s.norm
        self.last = n
        if math.isfinite(n):
            if self.min is None or n < self.min:  # comparisons: cheaper than min()/max()
                self.min = n
            if self.max is None or n > self.max:
                self.max = n
            self.total += n
            self.count += 1
        self.mean_abs = s.mean_abs
        self.max_abs = s.max_abs
        self.zero_fraction = 1.0 - s.nonzero / s.numel if s.numel else None
        self.param_norm = s.param_norm
        if s.delta_norm is not None and s.param_norm:
            self.update_ratio = s.delta_norm / s.param_norm
        self.history.append((step, n))

    def to_stats(self, name: str, params: list[str], numel: int, **extra: object) -> LayerStats:
        return LayerStats(
            name=name,
            params=params,
            numel=numel,
            grad_norm_last=self.last,
            grad_norm_min=self.min,
            grad_norm_max=self.max,
            grad_norm_mean=self.total / self.count if self.count else None,
            mean_abs_grad=self.mean_abs,
            max_abs_grad=self.max_abs,
            zero_fraction=self.zero_fraction,
            param_norm=self.param_norm,
            update_ratio=self.update_ratio,
            history=list(self.history),
            **extra,  # type: ignore[arg-type]
        )


def folded_samples(values: list[float], lay: Layout, numel: list[int]) -> dict[str, LayerSample]:
    """Per-layer samples from the step's folded columns (:func:`gradwatch.measure.columns.fold`).

    Every position live, measured and finite: one C-level pass builds the samples.
    """
    n = len(lay.names)
    norm, pnorm, delta, l1, nnz, top = (values[r * n : (r + 1) * n] for r in range(ROWS))
    sizes = lay.sizes(numel)
    mean_abs = list(map(truediv, l1, sizes))
    updates: list[Optional[float]] = list(delta)
    if any(map(isnan, delta)):  # NaN: an update unknown (or none measured)
        updates = [None if v != v else v for v in delta]
    return dict(
        zip(
            lay.names,
            map(LayerSample, lay.positions, norm, mean_abs, top, nnz, sizes, pnorm, updates),
        )
    )


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
        key = "grad_norm_total"
        if several_optimizers:  # named ones by name (optimizer_G), the others by position
            names = view.index.optimizer_names
            k = view.optimizer
            name = names[k] if k is not None and k < len(names) else None
            key = f"grad_norm_total/optimizer_{name if name is not None else k}"
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
