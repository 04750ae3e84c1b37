"""The per-layer work on columns (checks/layer_table.py, core/layers.py's block,
checks/_window.py's WindowColumns) against the one-layer-at-a-time code it replaces."""

from __future__ import annotations

import math
import random
from typing import Any, Optional

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks._window import MedianWindow, WindowColumns
from gradwatch.checks.exploding import ExplodingGrad
from gradwatch.checks.views import LayerTable, StepView, WindowEvidence
from gradwatch.config import GradWatchConfig
from gradwatch.core.layers import LayerRecorder, LayerTrack
from gradwatch.model.index import ParamIndex

NAMES = [f"layer{k}" for k in range(7)]


def _table(rnd: random.Random, names: list[str], *, partial: bool = False) -> LayerTable:
    n = len(names)
    pnorm: list[Optional[float]] = [rnd.uniform(0.5, 2.0) for _ in range(n)]
    delta: list[Optional[float]] = [rnd.uniform(0.0, 0.1) for _ in range(n)]
    if partial:  # one update unknown, one parameter norm zero: their ratios are kept
        delta[1], pnorm[2] = None, 0.0
    return LayerTable(
        names,
        [[k] for k in range(n)],
        [rnd.choice([rnd.uniform(0.0, 3.0), 1.0, 0.0, -0.0]) for _ in range(n)],
        [rnd.uniform(0.0, 1.0) for _ in range(n)],
        [rnd.uniform(0.0, 1.0) for _ in range(n)],
        [float(rnd.randint(0, 16)) for _ in range(n)],
        [16] * n,
        pnorm,
        delta,
    )


def _view(step: int, layers: Any, samples: Optional[int] = None) -> StepView:
    return StepView(
        step=step,
        optimizer=0,
        index=ParamIndex(),
        ids=[],
        arrived=[],
        has_grad=[],
        grad_norm=[],
        nonfinite=[],
        order=[],
        backward_in_window=True,
        observed=True,
        cause=lambda i: "",
        seen=[],
        missing=[],
        layers=layers,
        window=WindowEvidence(samples=samples),
    )


def _fields(t: LayerTrack) -> tuple[Any, ...]:
    return (
        t.last,
        t.min,
        t.max,
        t.total,
        t.count,
        t.mean_abs,
        t.max_abs,
        t.zero_fraction,
        t.param_norm,
        t.update_ratio,
        list(t.history),
    )


def test_the_columns_fold_as_one_update_per_layer_per_step() -> None:
    """Same layout each step (its list), some steps without every ratio, a non-finite step,
    a new list of the same names, the tracks read mid-run: the tracks and metrics equal
    LayerTrack.update's, value for value."""
    rnd = random.Random(3)
    rec = LayerRecorder(history=5, sinks=[])
    ref = {x: LayerTrack(5) for x in NAMES}
    for step in range(150):
        table = _table(rnd, NAMES, partial=step % 7 == 3)
        if step == 40:
            table = LayerTable.of(dict(table.items()))  # equal names, another list
        if step == 90:  # a non-finite step: one layer by one
            table.norm[4] = math.inf
            table = LayerTable.of(dict(table.items()))
        rec.record(_view(step, table), several_optimizers=False, findings=0, guard=_call)
        for x, s in table.items():
            ref[x].update(step, s)
        if step in (10, 64, 127):  # a read flushes; the next step starts a block again
            assert {x: _fields(t) for x, t in rec.tracks.items()} == {
                x: _fields(t) for x, t in ref.items()
            }
    assert {x: _fields(t) for x, t in rec.tracks.items()} == {x: _fields(t) for x, t in ref.items()}
    last = {f"grad_norm/{x}": t.last for x, t in ref.items()}
    assert {k: v for k, v in rec.metrics.items() if k.startswith("grad_norm/")} == last
    assert rec.metrics["findings"] == 0.0


def test_two_optimizers_layouts_alternate_and_overlap() -> None:
    """A GAN's two layouts (disjoint) take turns, each with its block; a third layout that
    overlaps both writes them back first; metrics keep each key's newest value."""
    rnd = random.Random(9)
    rec = LayerRecorder(history=70, sinks=[])
    ref = {x: LayerTrack(70) for x in NAMES}
    want: dict[str, float] = {}
    g, d, both = NAMES[:3], NAMES[3:], NAMES[2:5]
    for step in range(200):
        names = both if step in (77, 150) else (g if step % 2 else d)
        table = _table(rnd, names, partial=step % 9 == 4)
        rec.record(_view(step, table), several_optimizers=True, findings=step, guard=_call)
        for x, s in table.items():
            ref[x].update(step, s)
            want[f"grad_norm/{x}"] = s.norm
        if step == 130:
            assert rec.metrics["findings"] == 130.0
    assert {x: _fields(t) for x, t in rec.tracks.items()} == {x: _fields(t) for x, t in ref.items()}
    assert {k: v for k, v in rec.metrics.items() if k.startswith("grad_norm/")} == want
    assert rec.metrics["findings"] == 199.0


def test_a_long_run_folds_its_batches_in_order() -> None:
    """Norms that grow: the minimum comes from the first batch, the maximum from the last;
    300 steps, none read in between."""
    rnd = random.Random(4)
    rec = LayerRecorder(history=300, sinks=[])
    ref = {x: LayerTrack(300) for x in NAMES}
    for step in range(300):
        table = _table(rnd, NAMES)
        table.norm[:] = [rnd.uniform(1.0, 2.0) * (1 + step / 50) for _ in NAMES]
        rec.record(_view(step, table), several_optimizers=False, findings=0, guard=_call)
        for x, s in table.items():
            ref[x].update(step, s)
    assert {x: _fields(t) for x, t in rec.tracks.items()} == {x: _fields(t) for x, t in ref.items()}


def _call(_what: str, fn: Any, *a: Any) -> Any:
    return fn(*a)


def test_the_window_columns_push_as_each_window_alone() -> None:
    """Filling, full, odd and even counts, and one window pushed alone (counts differ)."""
    rnd = random.Random(5)
    mine = [MedianWindow(6) for _ in NAMES]
    theirs = [MedianWindow(6) for _ in NAMES]
    cols = WindowColumns(NAMES, mine)  # type: ignore[arg-type]
    for step in range(40):
        values = [rnd.choice([rnd.uniform(0, 5), 2.0]) for _ in NAMES]
        if step == 17:
            mine[3].push(9.0), theirs[3].push(9.0)
        got = cols.push(values)
        want = [w.push(v) for w, v in zip(theirs, values)]
        assert list(zip(*got)) == want, step
        assert [w._sorted for w in mine] == [w._sorted for w in theirs]


class _Log:
    def __init__(self) -> None:
        self.found: list[dict[str, Any]] = []

    def emit(self, check: str, **kw: Any) -> None:
        self.found.append(kw)


def _old_exploding(
    history: dict[str, MedianWindow],
    rising: dict[str, int],
    names: list[str],
    norms: list[float],
    step: int,
    cfg: Any,
    spread: bool,
) -> list[str]:
    """exploding_grad's per-layer loop before the columns (the layers that fire)."""
    fired = []
    for layer, norm in zip(names, norms):
        if not math.isfinite(norm):
            continue
        held, med, top = history.setdefault(layer, MedianWindow(8)).push(norm)
        if med > 0:
            if norm > 2.0 * med:
                rising.setdefault(layer, step)
            elif rising:
                rising.pop(layer, None)
        if cfg.max_norm is not None and norm > cfg.max_norm:
            fired.append(layer)
        elif held >= cfg.warmup:
            ref = top if spread else med
            if ref > 0 and norm > cfg.spike_factor * ref:
                fired.append(layer)
    return fired


@pytest.mark.parametrize("spread", [False, True])
def test_exploding_on_columns_fires_as_the_per_layer_loop(spread: bool) -> None:
    """Random spikes, zeros and non-finite norms: the same layers fire at the same steps,
    and the rising layers (spike attribution) are the same."""
    rnd = random.Random(7 + spread)
    cfg = {"history": 8, "checks": {"exploding_grad": {"warmup": 3, "spike_factor": 4.0}}}
    watch_config = GradWatchConfig.model_validate(cfg)
    check = ExplodingGrad(watch_config.check("exploding_grad"), watch_config)
    history: dict[str, MedianWindow] = {}
    rising: dict[str, int] = {}
    for step in range(120):
        norms = [rnd.choice([1.0, 1.1, 0.0, 30.0, 3.0, 2e4]) for _ in NAMES]
        if step % 11 == 5:
            norms[2] = math.nan
        log = _Log()
        view = _view(step, _table_of(norms), samples=2 if spread else None)
        check.on_step(view, log)  # type: ignore[arg-type]
        want = _old_exploding(history, rising, NAMES, norms, step, check.config, spread)
        assert [f["module"] for f in log.found] == want, step
        assert check._rise_began == rising, step


def _table_of(norms: list[float]) -> LayerTable:
    n = len(norms)
    ones = [1.0] * n
    return LayerTable(NAMES, [[] for _ in NAMES], norms, ones, ones, ones, [1] * n, ones, ones)


def test_a_loop_with_a_ghost_layer_keeps_its_tracks() -> None:
    """A layer without gradients every step (the host's fold, a new table each step): the
    report's tracks still count every step of the live layers."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    model = Two()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "history": 4}) as w:
        for _ in range(9):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    layers = {x.name: x for x in w.report().layers}
    assert [s for s, _ in layers["a"].history] == [5, 6, 7, 8]
    assert layers["a"].grad_norm_min is not None and layers["unused"].history == []
