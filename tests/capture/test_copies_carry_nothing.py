"""Copies of a watched model carry nothing of gradwatch's: deepcopy, pickle, AveragedModel,
``torch.save`` + ``torch.load(weights_only=True)``, and an ``mp.spawn`` child."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.capture.loop.copies import is_gradwatch_hook

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks_of(model: nn.Module) -> int:
    """Every module hook a model holds (the copies here had none of their own)."""
    return sum(len(getattr(m, attr)) for m in model.modules() for attr in HOOK_DICTS)


def gradwatch_hooks_of(model: nn.Module) -> int:
    return sum(
        is_gradwatch_hook(h)
        for m in model.modules()
        for attr in HOOK_DICTS
        for h in getattr(m, attr).values()
    )


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


@pytest.fixture
def watched() -> tuple[nn.Sequential, gradwatch.Watcher]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = gradwatch.watch(model, opt, config={"warn": False}).attach()
    step(model, opt)
    assert gradwatch_hooks_of(model) > 0  # the watched model itself is hooked
    yield model, watcher
    watcher.close()


def test_deepcopy_pickle_and_averaged_model_carry_no_hooks(
    watched: tuple[nn.Sequential, gradwatch.Watcher],
) -> None:
    model, _ = watched
    copies = [
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.optim.swa_utils.AveragedModel(model).module,
    ]
    for twin in copies:
        assert hooks_of(twin) == 0
        twin(torch.randn(2, 4))  # and they run
    assert gradwatch_hooks_of(model) > 0  # the original keeps its hooks while watched


def test_user_hooks_survive_the_copy(watched: tuple[nn.Sequential, gradwatch.Watcher]) -> None:
    model, _ = watched
    seen: list[int] = []
    model[0].register_forward_hook(print)  # a user's hook (never called here)
    handle = model[2].register_forward_pre_hook(lambda m, a: seen.append(1))
    twin = copy.deepcopy(model)
    assert hooks_of(twin) == 2 and gradwatch_hooks_of(twin) == 0
    handle.remove()


def test_torch_save_loads_with_weights_only(
    watched: tuple[nn.Sequential, gradwatch.Watcher],
) -> None:
    model, _ = watched
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU, set]):
        loaded = torch.load(buf, weights_only=True)
    assert hooks_of(loaded) == 0
    torch.testing.assert_close(loaded(torch.ones(1, 4)), model(torch.ones(1, 4)))


def _child(rank: int, model: nn.Module, out: str) -> None:
    Path(out, f"rank{rank}").write_text(str(hooks_of(model)))


@pytest.mark.slow
def test_mp_spawn_child_gets_no_hooks(
    watched: tuple[nn.Sequential, gradwatch.Watcher], tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    model, _ = watched
    mp.spawn(_child, args=(model, str(tmp_path)), nprocs=1, join=True)
    assert (tmp_path / "rank0").read_text() == "0"


def test_the_dispatch_entries_leave_with_the_watcher() -> None:
    import copyreg

    class Mine(nn.Linear):
        pass

    model = nn.Sequential(Mine(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}):
        assert Mine in copyreg.dispatch_table
    assert Mine not in copyreg.dispatch_table and nn.Sequential not in copyreg.dispatch_table
    assert hooks_of(copy.deepcopy(model)) == 0
