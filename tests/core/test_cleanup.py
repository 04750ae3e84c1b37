"""gradwatch leaves nothing behind: no hook, no reference to the model, no growing state."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import gradwatch


class Net(nn.Module):
    """A small net with a ghost head, a tied pair and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.unused = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.frozen(self.body(self.emb(ids))))


def hook_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every hook registry gradwatch could touch, as comparable plain data."""

    def keys(d: Any) -> list[Any]:
        return sorted(d.keys()) if d else []

    state: dict[str, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        state[f"param {name} post-accumulate"] = keys(p._post_accumulate_grad_hooks)
        state[f"param {name} tensor"] = keys(p._backward_hooks)
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            state[f"module {name or '(root)'} {attr}"] = keys(getattr(m, attr, None))
    state["optimizer pre"] = keys(opt._optimizer_step_pre_hooks)
    state["optimizer post"] = keys(opt._optimizer_step_post_hooks)
    for attr in (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    ):
        state[f"global {attr}"] = keys(getattr(nn_module, attr, None))
    state["global optimizer pre"] = keys(optim_module._global_optimizer_pre_hooks)
    state["global optimizer post"] = keys(optim_module._global_optimizer_post_hooks)
    return state


def step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    opt.zero_grad()
    ids = torch.randint(0, 10, (4, 3))
    loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    return loss


def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    # a user hook that must survive gradwatch's cleanup untouched
    model.body[0].register_forward_hook(lambda m, a, o: None)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def test_every_hook_is_removed_after_a_normal_exit() -> None:
    model, opt = setup()
    before = hook_state(model, opt)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        during = hook_state(model, opt)
        for _ in range(3):
            step(model, opt)
    assert during != before  # the comparison can see gradwatch's hooks
    assert hook_state(model, opt) == before
    assert w.report().steps == 3


def test_no_empty_tensor_hook_dict_is_left_to_call_after_the_trim_or_exit() -> None:
    """torch calls a tensor's hook dict from C++ on every backward, empty or not: a dict left
    empty by gradwatch costs each parameter a Python call per backward, for the whole run
    and after it (+0.35 ms a step on 400 small parameters). A user's own hook stays, and
    fires."""
    model, opt = setup()
    fired: list[int] = []
    model.body[2].weight.register_hook(lambda g: fired.append(1))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with gradwatch.watch(model, opt):
        for _ in range(12):  # past trim_hooks_after (8)
            step(model, opt)
        during = [p._backward_hooks for p in trainable]
    after = [p._backward_hooks for p in trainable]
    body2 = next(i for i, p in enumerate(trainable) if p is model.body[2].weight)
    for i, hooks in enumerate(after):
        if i == body2:
            assert hooks is not None and len(hooks) == 1
        else:
            assert hooks is None, f"parameter {i} keeps an empty hook dict after exit"
    assert sum(h is None for h in during) >= len(trainable) - 3  # trimmed: released too
    before = len(fired)
    step(model, opt)
    assert len(fired) == before + 1


class UserBug(Exception):
    pass


def user_bug(*args: object) -> None:
    """A user's hook (forward or tensor) that fails."""
    raise UserBug()


@pytest.mark.parametrize("where", ["forward", "backward", "between steps"])
def test_every_hook_is_removed_when_the_loop_raises(where: str) -> None:
    model, opt = setup()
    before = hook_state(model, opt)
    with pytest.raises(UserBug), gradwatch.watch(model, opt) as w:
        step(model, opt)
        if where == "forward":
            model.body[0].register_forward_hook(user_bug)
            model(torch.randint(0, 10, (2, 3)))
        elif where == "backward":
            out = model(torch.randint(0, 10, (2, 3)))
            out.register_hook(user_bug)
            out.sum().backward()
        else:
            raise UserBug()
    after = hook_state(model, opt)
    if where == "forward":  # the user's own failing hook is still there, only it
        key = "module body.0 _forward_hooks"
        assert len(after[key]) == len(before[key]) + 1
        after[key] = before[key]
    assert after == before
    assert w.report().steps == 1


def test_every_hook_is_removed_when_fail_fast_raises() -> None:
    model, opt = setup()
    before = hook_state(model, opt)
    with (
        pytest.raises(gradwatch.GhostLayerError),
        gradwatch.watch(model, opt, config={"fail_fast": True}),
    ):
        step(model, opt)
    assert hook_state(model, opt) == before


def test_hooks_added_for_late_parameters_are_removed_too() -> None:
    model, opt = setup()
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}):
        step(model, opt)
        model.late = nn.Linear(8, 8)
        opt.add_param_group({"params": list(model.late.parameters())})
        step(model, opt)
        step(model, opt)
        late = model.late.weight  # watched now: a post hook, or a light (pre-)hook
        assert late._post_accumulate_grad_hooks or late._backward_hooks
    assert not model.late.weight._post_accumulate_grad_hooks
    assert not model.late.weight._backward_hooks
    assert not model.late._forward_hooks


def test_model_optimizer_and_activations_are_freed_after_exit(tmp_path: Path) -> None:
    model, opt = setup()
    refs: dict[str, weakref.ref[Any]] = {"model": weakref.ref(model), "optimizer": weakref.ref(opt)}
    refs["param"] = weakref.ref(model.body[0].weight)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(3):
            loss = step(model, opt)
        hidden = model.body(model.emb(torch.randint(0, 10, (2, 3))))
        hidden.sum().backward()
        refs["activation"] = weakref.ref(hidden)
        refs["loss"] = weakref.ref(loss)
        refs["grad"] = weakref.ref(model.body[0].weight.grad)
    del model, opt, loss, hidden
    gc.collect()
    alive = sorted(name for name, r in refs.items() if r() is not None)
    assert alive == []
    # the watcher object is still alive and its report readable
    report = w.report()
    assert report.steps == 3
    assert report.by_check("ghost_param")[0].params == ["unused.weight", "unused.bias"]
    report.write(tmp_path / "r.json")
    assert gradwatch.Report.read(tmp_path / "r.json") == report


def test_model_is_freed_after_an_exception_in_the_loop() -> None:
    model, opt = setup()
    ref = weakref.ref(model)
    with pytest.raises(UserBug), gradwatch.watch(model, opt) as w:
        step(model, opt)
        raise UserBug()
    del model, opt
    gc.collect()
    assert ref() is None
    assert w.report().steps == 1


def test_watcher_does_not_keep_itself_alive_through_hooks() -> None:
    """Dropping an exited watcher frees it (hooks only hold weak references to it)."""
    model, opt = setup()
    with gradwatch.watch(model, opt) as w:
        step(model, opt)
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None


def _gradwatch_bytes(snapshot: tracemalloc.Snapshot) -> int:
    return sum(s.size for s in snapshot.statistics("filename"))


@pytest.mark.parametrize(
    "steps", [300, pytest.param(2000, marks=pytest.mark.slow)], ids=["300", "2000"]
)
def test_gradwatch_memory_is_flat_over_many_steps(steps: int) -> None:
    """Over many steps after warm-up gradwatch's own allocations do not grow.

    ``every_n_steps=1`` makes every step an observed one (statistics, history, metrics);
    the model has a ghost layer so findings are merged every step as well. A leak of one
    small object per step (~30 bytes) would already cross the threshold at 300 steps; the
    2,000-step run (about 20 s under tracemalloc) is marked slow.
    """
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "body": nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
            "ghost": nn.Linear(2, 2),
        }
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    pkg = str(Path(gradwatch.__file__).parent)
    filters = [tracemalloc.Filter(True, f"{pkg}/*")]

    def train(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            nn.functional.mse_loss(model["body"](x), y).backward()
            opt.step()

    cfg = {"every_n_steps": 1, "history": 32}
    with gradwatch.watch(model, opt, config=cfg) as w:
        tracemalloc.start()
        try:
            # Warm-up: fills the bounded history, first findings, and CPython's free lists
            # (freed tuples stay "allocated" to tracemalloc at their first site: bounded).
            train(60 + steps)
            gc.collect()
            first = tracemalloc.take_snapshot().filter_traces(filters)
            train(steps)
            gc.collect()
            last = tracemalloc.take_snapshot().filter_traces(filters)
        finally:
            tracemalloc.stop()
    growth = _gradwatch_bytes(last) - _gradwatch_bytes(first)
    top = last.compare_to(first, "lineno")[:5]
    # torch's own small allocations made inside our calls (argument parsing, dispatch caches)
    # are attributed to our lines and drift by a few KiB either way; a leak of one 60-byte
    # object per step crosses 16 KiB at 300 steps, and 8 bytes per step at 2,000.
    assert growth < 16384, "\n".join(str(s) for s in top)
    report = w.report()
    assert report.steps == 60 + 2 * steps
    assert all(
        len(layer.history) == 32
        for layer in report.layers
        if layer.trainable and layer.name != "ghost"
    )
    assert report.by_check("ghost_param")[0].count == 60 + 2 * steps
