"""``gradwatch._loads``: ``nn.Module.load_state_dict`` wrapped from import, and transparent.

The wrapper stands for the whole process, around every load of every program that imports
gradwatch (the pytest plugin does), so it must not show: the same result, the same
exceptions, the same signature, another library's wrapper over or under it working, a fault
of its own swallowed, memory bounded and no model kept alive.
"""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import _loads

ROOT = Path(__file__).resolve().parents[2]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _prefixed() -> dict[str, torch.Tensor]:
    return {"module." + k: v for k, v in _net().state_dict().items()}


@pytest.fixture(autouse=True)
def _no_loads_left() -> Any:
    _loads.take(lambda m: True)
    yield
    _loads.take(lambda m: True)


def test_the_wrapper_looks_like_torchs() -> None:
    ours = nn.Module.load_state_dict
    assert _loads.wrapped(nn.Module)
    theirs = ours.__wrapped__  # type: ignore[attr-defined]
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert (ours.__name__, ours.__qualname__, ours.__doc__) == (
        theirs.__name__,
        theirs.__qualname__,
        theirs.__doc__,
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda m, sd: m.load_state_dict(sd, strict=False),
        lambda m, sd: m.load_state_dict(sd, False),
        lambda m, sd: m.load_state_dict(state_dict=sd, strict=False, assign=True),
        lambda m, sd: nn.Module.load_state_dict(m, sd, False, False),
    ],
)
def test_same_result_in_every_calling_form(call: Any) -> None:
    sd = {**_prefixed(), "0.weight": torch.ones(4, 4)}
    theirs = nn.Module.load_state_dict.__wrapped__  # type: ignore[attr-defined]
    expected = theirs(_net(), sd, strict=False)
    model = _net()
    got = call(model, sd)
    assert type(got) is type(expected) and got == expected
    assert torch.equal(model[0].weight, torch.ones(4, 4))
    (kept,) = _loads.take(lambda m: m is model)
    assert kept.loaded == 1 and ("0.bias", "module.0.bias") in kept.pairs


def test_same_exceptions() -> None:
    theirs = nn.Module.load_state_dict.__wrapped__  # type: ignore[attr-defined]
    errors = []
    for load in (nn.Module.load_state_dict, theirs):
        with pytest.raises(RuntimeError) as info:
            load(_net(), _prefixed())  # strict=True: missing and unexpected keys
        errors.append(str(info.value))
        with pytest.raises(TypeError):
            load(_net())  # no state dict at all
    assert errors[0] == errors[1]
    assert not _loads.take(lambda m: True)


def test_a_fault_in_the_wrapper_never_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any) -> Any:
        raise RuntimeError("gradwatch bug")

    monkeypatch.setattr(_loads, "analyse", broken)
    result = _net().load_state_dict(_prefixed(), strict=False)
    assert len(result.missing_keys) == 6


def test_another_librarys_wrapper_over_ours_keeps_both_working() -> None:
    ours = nn.Module.load_state_dict
    seen = []

    def theirs(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("strict"))
        return ours(self, *args, **kwargs)

    nn.Module.load_state_dict = theirs  # type: ignore[method-assign]
    try:
        model = _net()
        model.load_state_dict(_prefixed(), strict=False)  # before the watch: kept through theirs
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert nn.Module.load_state_dict is theirs  # the watcher left theirs in place
    finally:
        nn.Module.load_state_dict = ours  # type: ignore[method-assign]
    assert seen == [False]
    assert [f.check for f in w.report().findings] == ["call_without_effect"]


def test_memory_is_bounded_and_models_are_not_kept() -> None:
    models = [_net() for _ in range(_loads.KEEP + 4)]
    for m in models:
        m.load_state_dict(_prefixed(), strict=False)
    ref = weakref.ref(models[-1])
    kept = list(_loads._records)
    assert len(kept) == _loads.KEEP and all(isinstance(k.module, weakref.ref) for k in kept)
    assert not any(isinstance(v, torch.Tensor) for k in kept for v in vars(k).values())
    del models, kept, m
    gc.collect()
    assert ref() is None
    assert not _loads.take(lambda m: True)  # dead modules are dropped


_SCRIPT = """
import sys
import gradwatch
assert "torch" not in sys.modules  # import gradwatch alone still does not import torch
import torch
from torch import nn
from gradwatch import _loads

print("wrapped", _loads.wrapped(nn.Module))
print("hook left", not any(type(f).__name__ == "_AfterTorch" for f in sys.meta_path))
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
model.load_state_dict({"module." + k: v for k, v in model.state_dict().items()}, strict=False)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with gradwatch.watch(model, opt, config={"warn": False}) as w:
    model[1].load_state_dict({"fc." + k: v for k, v in model[1].state_dict().items()}, strict=False)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
print("found", sorted(f.details["before_watch"] for f in w.report().findings))
print("after", _loads.wrapped(nn.Module))
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("1", ["wrapped True", "hook left True", "found [False, True]", "after True"]),
        ("0", ["wrapped False", "hook left True", "found [False]", "after False"]),
    ],
)
def test_import_gradwatch_before_torch(env: str, expected: list[str]) -> None:
    """The usual order (isort puts ``gradwatch`` before ``torch``): the import hook wraps
    torch's method once torch is imported, then leaves; turned off, only loads made while
    watching are judged."""
    environ = {**os.environ, "GRADWATCH_RECORD_LOADS": env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=environ,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:-1] == expected
