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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import repeat
from math import inf, isnan
from operator import add, mul, truediv
from typing import Any, Callable, Optional

from gradwatch.checks.views import LayerSample, LayerTable, StepView
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


def folded_samples(values: list[float], lay: Layout, numel: list[int]) -> LayerTable:
    """Per-layer samples from the step's folded columns (:func:`gradwatch.measure.columns.fold`).

    Every position live, measured and finite: the columns are slices of the host values,
    and the table's ``names`` is the layout's own list (its readers cache by it).
    """
    n = len(lay.names)
    norm, pnorm, delta, l1, nnz, top = (values[r * n : (r + 1) * n] for r in range(ROWS))
    sizes = lay.sizes(numel)
    mean_abs = list(map(truediv, l1, sizes))
    updates: list[Optional[float]] = list(delta)
    if any(map(isnan, delta)):  # NaN: an update unknown (or none measured)
        updates = [None if v != v else v for v in delta]
    return LayerTable(lay.names, lay.positions, norm, mean_abs, top, nnz, sizes, pnorm, updates)


class _Block:
    """The layer tracks of one layout's layers as columns, folded in batches.

    On an every-step run of a deep stack, 200 :meth:`LayerTrack.update` calls cost about
    0.1 ms a step, and even C-level passes (``map(min, ...)``) cost 20 us each per step.
    While steps come with the same layers (the same ``names`` list, or an equal one) and
    every norm is finite, a step copies its norms into a row of a buffer allocated once and
    keeps its table. Every ``_BATCH`` steps, and when the tracks are read, the rows are
    folded in with one pass per field over all of them (``min`` of 65 values costs little
    more than of 2), in step order: the running values that one update per step gives
    (``min`` keeps the earliest of equals, totals add one value at a time). The buffer's rows are
    overwritten, never dropped: what the block holds does not depend on the batch's phase.
    """

    __slots__ = (
        "count",
        "history",
        "keys",
        "max",
        "min",
        "names",
        "pending",
        "ratio",
        "rows",
        "steps",
        "table",
        "tracks",
    )

    def __init__(self, names: list[str], tracks: list[LayerTrack]) -> None:
        self.names = names
        self.tracks = tracks
        self.history = [t.history for t in tracks]
        self.keys = [f"grad_norm/{x}" for x in names]
        self.min = [inf if t.min is None else t.min for t in tracks]
        self.max = [-inf if t.max is None else t.max for t in tracks]
        self.count = [(t.count, t.total) for t in tracks]
        self.ratio: list[Optional[float]] = [t.update_ratio for t in tracks]
        self.table: Optional[LayerTable] = None  # the last step's
        self.rows = [[0.0] * len(names) for _ in range(_BATCH)]  # the pending steps' norms
        self.steps = [0] * _BATCH
        self.pending = 0

    def update(self, step: int, table: LayerTable) -> None:
        """One step whose every layer norm is finite (``table.finite``)."""
        if not _full_ratios(table):  # a ratio this step lacks is kept from the one before
            self.ratio = self.ratios()
        self.table = table
        k = self.pending
        self.rows[k][:] = table.norm
        self.steps[k] = step
        self.pending = k + 1
        if self.pending == _BATCH:
            self.fold()

    def ratios(self) -> list[Optional[float]]:
        """The update ratios as of the last step: kept where it had none."""
        t = self.table
        if t is None:
            return self.ratio
        if _full_ratios(t):
            return list(map(truediv, t.delta_norm, t.param_norm))  # type: ignore[arg-type]
        return [
            d / p if d is not None and p else r
            for r, d, p in zip(self.ratio, t.delta_norm, t.param_norm)
        ]

    def fold(self) -> None:
        """Fold the pending rows into the running columns and the histories."""
        k = self.pending
        if not k:
            return
        rows, steps = self.rows[:k], self.steps[:k]
        self.ratio = self.ratios()
        self.min = list(map(min, self.min, *rows))  # the earliest of equals: as update
        self.max = list(map(max, self.max, *rows))
        # reduce(add): one addition at a time, as update (sum() compensates from Python 3.12)
        self.count = [(c + k, reduce(add, v, t)) for (c, t), v in zip(self.count, zip(*rows))]
        _run(map(deque.extend, self.history, map(zip, repeat(steps), zip(*rows))))
        self.pending = 0

    def flush(self) -> None:
        """Write the columns back into the tracks."""
        self.fold()
        t = self.table
        if t is None:
            return
        numel = t.numel
        zero = [1.0 - z / n if n else None for z, n in zip(t.nonzero, numel)]
        last = zip(t.norm, t.mean_abs, t.max_abs, zero, t.param_norm, self.ratio)
        for r, (lt, values) in enumerate(zip(self.tracks, last)):
            lt.last, lt.mean_abs, lt.max_abs, lt.zero_fraction, lt.param_norm = values[:5]
            lt.update_ratio = values[5]
            lt.count, lt.total = self.count[r]
            if lt.count:
                lt.min, lt.max = self.min[r], self.max[r]


def _full_ratios(t: LayerTable) -> bool:
    """Whether every layer of ``t`` has an update ratio (an update and a non-zero norm)."""
    return all(t.param_norm) and None not in t.delta_norm  # all(): no None, no zero


_BATCH = 64  # steps between two folds of the running minimum, maximum and total (rows)
_BLOCKS = 8  # layouts whose blocks are kept at once


def _run(it: Iterable[Any]) -> None:
    deque(it, maxlen=0)  # a map run for its effects, at C speed


class LayerRecorder:
    """Keeps each layer's :class:`LayerTrack` and the latest metrics; feeds the sinks.

    The tracks of a layout's layers are updated as one :class:`_Block` on the usual step;
    one block per layout, kept while the layouts' layers do not overlap (a GAN's two
    optimizers each have theirs), at most ``_BLOCKS``.
    """

    def __init__(self, history: int, sinks: Sequence[Any]) -> None:
        self.history = history
        self.sinks = list(sinks)
        self._tracks: dict[str, LayerTrack] = {}
        self._metrics: dict[str, float] = {}
        # not merged into ``_metrics`` yet: each block's last norms, the other values
        self._latest: dict[int, tuple[list[str], list[float]]] = {}
        self._others: dict[str, float] = {}
        self._keys: dict[str, str] = {}
        self._blocks: list[_Block] = []

    @property
    def tracks(self) -> dict[str, LayerTrack]:
        """Each layer's track, up to date."""
        for block in self._blocks:
            block.flush()
        return self._tracks

    @property
    def metrics(self) -> dict[str, float]:
        """The latest value of each metric (built when read: most runs have no sink)."""
        if self._latest or self._others:
            merged = dict(self._metrics)
            for keys, norms in self._latest.values():
                merged.update(zip(keys, norms))
            merged.update(self._others)
            self._metrics, self._latest, self._others = merged, {}, {}
        return self._metrics

    def _drop(self, blocks: list[_Block]) -> None:
        """Write ``blocks`` back and forget them (their metrics merged first)."""
        self.metrics  # noqa: B018 (merged: a dropped block's entry must not stay)
        for block in blocks:
            block.flush()
            self._blocks.remove(block)

    def _track(self, layer: str) -> LayerTrack:
        lt = self._tracks.get(layer)
        if lt is None:
            lt = self._tracks[layer] = LayerTrack(self.history)
            self._keys[layer] = f"grad_norm/{layer}"  # built once per layer, not per step
        return lt

    def _block(self, names: list[str]) -> _Block:
        """The block of ``names`` (the same list, or an equal one), made if none."""
        for block in self._blocks:
            if block.names is names:
                return block
        for block in self._blocks:
            if block.names == names:
                return block
        mine = set(names)
        self._drop([b for b in self._blocks if not mine.isdisjoint(b.names)])
        if len(self._blocks) >= _BLOCKS:
            self._drop(self._blocks[:1])
        block = _Block(names, [self._track(x) for x in names])
        self._blocks.append(block)
        return block

    def _fold(self, view: StepView) -> tuple[float, list[str], list[float]]:
        """Fold the step's layers into the tracks; (sum of squared norms, metric keys, norms)."""
        table = LayerTable.of(view.layers)
        if table.finite and table.names:  # the usual step: its layout's block
            block = self._block(table.names)
            block.update(view.step, table)
            norms = table.norm
            self._latest[id(block)] = (block.keys, norms)  # live blocks' keys are disjoint
            return reduce(add, map(mul, norms, norms), 0.0), block.keys, norms
        self._drop(list(self._blocks))  # one layer at a time: no block holds newer values
        keys, total = self._keys, 0.0
        norms = []
        for layer, sample in view.layers.items():
            self._track(layer).update(view.step, sample)
            norm = sample.norm
            total += norm * norm
            norms.append(norm)
        names = [keys[x] for x in view.layers]
        self._metrics = {**self._metrics, **dict(zip(names, norms))}
        return total, names, norms

    def record(
        self,
        view: StepView,
        *,
        several_optimizers: bool,
        findings: int,
        guard: Callable[..., Any],
    ) -> None:
        """Fold one observed step into the layer tracks and send its metrics to the sinks."""
        total, keys, norms = self._fold(view)
        # With several optimizers each step sees its own layers: name the total per optimizer
        # so that sinks do not get two different values for one series at one step.
        key = "grad_norm_total"
        if several_optimizers:  # named ones by name (optimizer_G), the others by position
            names = view.index.optimizer_names
            k = view.optimizer
            name = names[k] if k is not None and k < len(names) else None
            key = f"grad_norm_total/optimizer_{name if name is not None else k}"
        extra = {key: total**0.5, "findings": float(findings)}
        self._others.update(extra)
        if self.sinks:
            metrics = dict(zip(keys, norms))
            metrics.update(extra)
            for sink in self.sinks:
                guard("sink", sink.log_metrics, view.step, dict(metrics))

    def close_sinks(self, guard: Callable[..., Any]) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                guard("sink close", close)
