"""Arrivals read at the step (capture/grads/step_reading.py): the same findings as with every hook on.

Each loop runs on a model of ~100 tensors (enough for the step to read arrivals) twice: with
the default configuration, where most post hooks come off after the first steps, and with
``trim_hooks_after: null``, where every hook stays on: the ground truth. The bugs start after
the reading has begun, so each finding must come from a step that read arrivals.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.capture.grads import step_reading
from gradwatch.capture.grads.step_reading import MIN_READ, PACE, ROTATE

Loop = Callable[[int, nn.Module, torch.optim.Optimizer, "Deep"], None]
LATE = 15  # every bug starts here, well after the reading begins (trim_hooks_after: 8)
STEPS = 40


class Deep(nn.Module):
    """A residual MLP of 2 * depth + 2 tensors; ``skip`` leaves layers out of the forward."""

    def __init__(self, depth: int = 52) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.head = nn.Linear(8, 1)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            if k not in self.skip:
                x = x + 0.1 * torch.tanh(block(x))
        return self.head(x)


def _run(
    loop: Optional[Loop], *, every_hook: bool, steps: int = STEPS, light: bool = True, **cfg: Any
) -> tuple[gradwatch.Report, list[float], Deep, int]:
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]
    config = {"trim_hooks_after": None, **cfg} if every_hook else cfg
    losses: list[float] = []
    read = 0
    watcher = gradwatch.watch(model, opt, config=config)
    # light=False: post hooks only, no deferred ones (capture/grads/deferred.py)
    watcher._hooks.arrival.light = watcher._hooks.arrival.light and light
    with watcher as w:
        for s in range(steps):
            x, y = data[s % len(data)]
            if loop is None:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
            else:
                loop(s, model, opt, Deep)
                loss = torch.zeros(())
            losses.append(loss.item())
            read = max(read, len(w._hooks.unhooked))
    return w.report(), losses, model, read


# How far a NaN's phase was traced depends on when the NaN probe is armed, not on reading
# arrivals: with every hook on (``trim_hooks_after: None``) it is armed on every step and sees
# the first NaN step's finite forward (``backward``); otherwise it arms after the first NaN and
# finds the weights already NaN (``phase: null``, ``weights_nonfinite``). Compared apart.
TRACE = ("phase", "weights_nonfinite")


def _findings(report: gradwatch.Report) -> set[tuple[str, str, tuple[str, ...], str]]:
    """Each finding with its details (the runs train bit-identically: they must be equal)."""
    return {
        (
            f.check,
            f.severity,
            tuple(sorted(f.params)),
            json.dumps({k: v for k, v in f.details.items() if k not in TRACE}, sort_keys=True),
        )
        for f in report.findings
    }


def _data(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s % 8)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _plain(s: int, model: nn.Module, opt: torch.optim.Optimizer, reset: bool = True) -> None:
    x, y = _data(s)
    if reset:
        opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_a_clean_loop_reads_arrivals_and_trains_as_unwatched() -> None:
    report, losses, model, read = _run(None, every_hook=False)
    assert read >= MIN_READ - 16  # most post hooks came off
    assert report.steps == STEPS
    assert _findings(report) == set()
    torch.manual_seed(0)
    twin = Deep()
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)]
    for s in range(STEPS):
        x, y = data[s % 8]
        opt.zero_grad()
        loss = nn.functional.mse_loss(twin(x), y)
        assert loss.item() == losses[s]
        loss.backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_every_hook_is_removed_on_exit_also_the_ones_put_back_in_turn() -> None:
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt) as w:
        for s in range(20):
            _plain(s, model, opt)
        assert w._hooks.unhooked
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
        assert not p._backward_hooks


def _late_ghost(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    model.skip = {30} if s >= LATE else set()  # type: ignore[assignment]
    _plain(s, model, opt)


def _late_ghost_zero_filled(
    s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any, layer: int = 30
) -> None:
    """A late ghost whose missing gradient the loop fills with zeros (a DDP workaround):
    no hook fires, yet ``.grad`` is a new tensor each step. Only a hook can tell."""
    model.skip = {layer} if s >= LATE else set()  # type: ignore[assignment]
    x, y = _data(s)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()


def _layerdrop(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    g = torch.Generator().manual_seed(100 + s)
    model.skip = {k for k in range(52) if torch.rand((), generator=g) < 0.2}  # type: ignore[assignment]
    _plain(s, model, opt)


def _no_zero_grad_once(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    _plain(s, model, opt, reset=s != LATE + 5)


def _no_zero_grad_from_late(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    _plain(s, model, opt, reset=s < LATE)


def _zero_grad_before_step(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    x, y = _data(s)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if s == LATE + 5:
        opt.zero_grad()  # the bug: the step applies no gradient
    opt.step()


def _nan_in_a_block(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    x, y = _data(s)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if s >= LATE + 5:
        with torch.no_grad():
            model.blocks[40].weight.grad[0, 0] = float("nan")  # type: ignore[index]
    opt.step()


def _double_step(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    _plain(s, model, opt)
    if s == LATE + 3:
        opt.step()


def _accumulate(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    opt.zero_grad()
    for k in range(3):
        x, y = _data(3 * s + k)
        (nn.functional.mse_loss(model(x), y) / 3).backward()
    opt.step()


def _freeze_late(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    if s == LATE:
        model.blocks[5].requires_grad_(False)  # type: ignore[index]
    _plain(s, model, opt)


def _freeze_and_thaw(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    if s in (LATE, LATE + 5):
        model.blocks[5].requires_grad_(s == LATE + 5)  # type: ignore[index]
    _plain(s, model, opt)


def _group_added_late(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    """A layout change (a new param group) re-reads the layout: read parameters stay read."""
    if s == LATE:
        extra = nn.Linear(1, 1)
        model.add_module("extra", extra)
        opt.add_param_group({"params": list(extra.parameters())})
    x, y = _data(s)
    opt.zero_grad()
    out = model(x)
    if s >= LATE:
        out = model.extra(out)  # type: ignore[operator]
    nn.functional.mse_loss(out, y).backward()
    opt.step()


def _zero_inplace(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    x, y = _data(s)
    opt.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _closure_late_ghost(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    """Lightning's shape: zero_grad, forward and backward run inside ``step(closure)``."""
    model.skip = {30} if s >= LATE else set()  # type: ignore[assignment]

    def closure() -> torch.Tensor:
        x, y = _data(s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)


def _zero_grad_after_step(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    """backward, step, zero_grad (the reset at the end of the iteration), and a late ghost."""
    model.skip = {30} if s >= LATE else set()  # type: ignore[assignment]
    x, y = _data(s)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _grad_dropped_late(s: int, model: nn.Module, opt: torch.optim.Optimizer, _: Any) -> None:
    """The loop sets one layer's gradients to None between backward and step."""
    x, y = _data(s)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if s >= LATE:
        for p in model.blocks[20].parameters():  # type: ignore[index]
            p.grad = None
    opt.step()


LOOPS = {
    "late_ghost": _late_ghost,
    "late_ghost_zero_filled": _late_ghost_zero_filled,
    "layerdrop": _layerdrop,
    "no_zero_grad_once": _no_zero_grad_once,
    "no_zero_grad_from_late": _no_zero_grad_from_late,
    "zero_grad_before_step": _zero_grad_before_step,
    "nan_in_a_block": _nan_in_a_block,
    "double_step": _double_step,
    "accumulate": _accumulate,
    "freeze_late": _freeze_late,
    "freeze_and_thaw": _freeze_and_thaw,
    "group_added_late": _group_added_late,
    "zero_inplace": _zero_inplace,
    "closure_late_ghost": _closure_late_ghost,
    "zero_grad_after_step": _zero_grad_after_step,
    "grad_dropped_late": _grad_dropped_late,
}

# What a finding may differ in when its step read arrivals: a step whose reading was in doubt
# judges only the hooked parameters (never a guess), so the finding names fewer of them.
SUBSET = {"zero_grad_before_step"}
# A gradient the loop drops (``p.grad = None``) reads as none arrived until the parameter's
# turn to be compared comes (docs/limits.md): an intermittent ghost at ``info``, for at
# most PACE * n / ROTATE steps, where every hook on says nothing. Nothing else may differ.
DROPPED = {"grad_dropped_late": ("blocks.20.bias", "blocks.20.weight")}


def _turns() -> int:
    """Steps to compare every read parameter of ``Deep``: a turn of ROTATE every PACE steps."""
    return -(-len(list(Deep().parameters())) // ROTATE) * PACE


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_findings_match_every_hook_on(name: str) -> None:
    loop = LOOPS[name]
    truth, _, _, never = _run(loop, every_hook=True)
    got, _, _, read = _run(loop, every_hook=False)
    assert never == 0
    assert got.steps == truth.steps >= STEPS
    want, have = _findings(truth), _findings(got)
    if name in DROPPED:
        extra = have - want
        have -= extra
        for check, sev, params, details in extra:
            assert (check, sev, params) == ("ghost_param", "info", DROPPED[name])
            assert json.loads(details)["steps_missing"] <= _turns() + 1
    if name in SUBSET:
        assert {f[:2] for f in have} == {f[:2] for f in want}
        for check, sev, params, _ in have:
            full = next(p for c, s, p, _ in want if (c, s) == (check, sev))
            assert set(params) <= set(full) and params
    else:
        assert have == want
    if name == "zero_inplace":
        assert read == 0  # the same tensor each step: only a hook can tell, so none came off
    else:
        assert read >= MIN_READ - 16, "the reading never started: the test proves nothing"
    if name == "nan_in_a_block":
        (f,) = got.by_check("nonfinite_grad")
        assert f.details["origin_layer"] == "blocks.40"  # where it started, in backward order
        assert f.details["origin_module"] == "blocks.40"  # not a container around it
        assert (f.details["phase"], f.details.get("weights_nonfinite")) == (None, True)
        (t,) = truth.by_check("nonfinite_grad")
        assert t.details["phase"] == "backward"  # the NaN was written into .grad after backward


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_deferred_arrival_hooks_find_what_post_hooks_find(name: str) -> None:
    """Every hook on all run long: the arrival hooks light (tensor pre-hooks whose work waits
    for the next hook or the backward's end, ``capture/grads/deferred.py``) or post hooks."""
    post, post_losses, _, _ = _run(LOOPS[name], every_hook=True, light=False)
    light, losses, _, _ = _run(LOOPS[name], every_hook=True)
    assert losses == post_losses
    assert _findings(light) == _findings(post)
    assert light.steps == post.steps and light.backward_passes == post.backward_passes


def test_the_bugs_fire_at_all() -> None:
    """The ground truth itself: each bug loop has its finding (the comparison is not empty)."""
    expect = {
        "late_ghost": "ghost_param",
        "late_ghost_zero_filled": "ghost_param",
        "no_zero_grad_once": "missing_zero_grad",
        "no_zero_grad_from_late": "missing_zero_grad",
        "zero_grad_before_step": "step_without_grad",
        "nan_in_a_block": "nonfinite_grad",
        "double_step": "double_update",
        "freeze_late": None,
        "closure_late_ghost": "ghost_param",
        "zero_grad_after_step": "ghost_param",
    }
    for name, check in expect.items():
        report, _, _, _ = _run(LOOPS[name], every_hook=False)
        if check is not None:
            assert report.by_check(check), name


def test_a_layout_change_leaves_read_parameters_unhooked() -> None:
    """Re-reading the layout (a new param group) must not put a second hook on a read one."""
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt) as w:
        for s in range(LATE + 10):
            _group_added_late(s, model, opt, None)
        hooks = w._hooks
        assert len(hooks.unhooked) >= MIN_READ - 16
        counts = {n: len(p._post_accumulate_grad_hooks or {}) for n, p in model.named_parameters()}
        assert max(counts.values()) == 1
        # the ones hooked in turn carry a light (pre-)hook instead: capture/grads/deferred.py
        assert sum(counts.values()) + len(hooks.arrival.lit) == len(hooks.param)


def test_the_gather_takes_the_readings_gradients_and_nothing_keeps_them() -> None:
    """The step's gather takes the ``.grad`` list the reading made (one read of each), and
    nothing holds it afterwards: the next ``zero_grad`` frees those gradients."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    taken: list[bool] = []
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        reading = w._pipe.reading
        real = reading.take_grads

        def spy() -> Any:
            got = real()
            taken.append(got is not None and got[0] is w._pipe.structure.tracks[0].params)
            return got

        reading.take_grads = spy  # type: ignore[method-assign]
        for _ in range(20):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert w._hooks.unhooked, "the step reads arrivals"
        assert taken[-1] and reading.grads is None
        left = [weakref.ref(p.grad) for p in model.parameters()]
        opt.zero_grad()
        gc.collect()
        assert all(r() is None for r in left)


@pytest.mark.parametrize("layer", [17, 30, 31])
def test_a_zero_filled_late_ghost_is_found_within_the_turns_wherever_it_is(layer: int) -> None:
    """Only a hook sees a ghost whose gradients the loop fills with zeros. Where no sentinel
    sits in its layer (17, 31; 30 has one), the reading finds it when a turn hooks it: the
    same finding as with every hook on, later by at most the turns' bound (docs/limits.md),
    never a different check or severity."""

    def loop(s: int, model: nn.Module, opt: torch.optim.Optimizer, cls: Any) -> None:
        _late_ghost_zero_filled(s, model, opt, cls, layer=layer)

    truth = _run(loop, every_hook=True)[0]
    got = _run(loop, every_hook=False)[0]
    want = [(f.check, f.severity, sorted(f.params)) for f in truth.findings]
    assert [(f.check, f.severity, sorted(f.params)) for f in got.findings] == want
    assert want == [("ghost_param", "info", [f"blocks.{layer}.bias", f"blocks.{layer}.weight"])]
    late = truth.findings[0].details["steps_missing"] - got.findings[0].details["steps_missing"]
    assert 0 <= late <= _turns() + 1


@pytest.mark.parametrize("sentinels", [2, 4, 16])
@pytest.mark.parametrize(("depth", "layer"), [(35, 20), (52, 30), (80, 41), (200, 150)])
def test_a_zero_filled_late_ghost_is_never_an_error_whatever_the_models_size(
    depth: int, layer: int, sentinels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop fills a late ghost's missing gradients with zeros (a DDP workaround): only a
    hook can tell. When a hook in turn sees it, every hook comes back and the parameters read
    until then are not judged in that window. Their ``.grad`` as the step left it must still
    be recorded: a stale record read as an edit after the step at the next ``zero_grad``, a
    false ``clip_after_step`` error, whenever the reset's sample of parameters fell on ones
    read until then (with 2 or 4 sentinels on every model size here; 16 hid it)."""
    monkeypatch.setattr(step_reading, "SENTINELS", sentinels)
    torch.manual_seed(0)
    model = Deep(depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt) as w:
        for s in range(STEPS):
            _late_ghost_zero_filled(s, model, opt, Deep, layer=layer)
    report = w.report()
    assert report.steps == STEPS
    assert {(f.check, f.severity) for f in report.findings} <= {("ghost_param", "info")}
