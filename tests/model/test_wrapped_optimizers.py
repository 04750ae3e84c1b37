"""``watch()`` follows ``.optimizer`` to the real optimizer: hand-written and Lightning wrappers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.model.optimizers import unwrap_optimizer


class Wrapper:
    """A hand-written wrapper that is no ``Optimizer``: steps through to the one inside."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def _model(ghost: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 1)})
    if ghost:
        model["ghost"] = nn.Linear(4, 4)
    return model


def _loop(model: nn.Module, opt: Any, steps: int = 4, stepper: Any = None) -> gradwatch.Report:
    watched, opt = opt, stepper or opt
    with gradwatch.watch(model, watched, config={"every_n_steps": 1}) as w:
        for _ in range(steps):
            opt.zero_grad()
            model["b"](model["a"](torch.randn(3, 4))).pow(2).mean().backward()
            opt.step()
    return w.report()


@pytest.mark.parametrize("depth", [1, 2])
def test_chain_of_wrappers_is_followed(depth: int) -> None:
    model = _model(ghost=True)
    opt: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
    real = opt
    for _ in range(depth):
        opt = Wrapper(opt)
    assert unwrap_optimizer(opt) is real
    report = _loop(model, opt)
    assert report.steps == 4
    assert {p for f in report.by_check("ghost_param") for p in f.params} == {
        "ghost.weight",
        "ghost.bias",
    }


@pytest.mark.floor  # LightningOptimizer
def test_lightning_optimizer_is_unwrapped() -> None:
    lo = pytest.importorskip("lightning.pytorch.core.optimizer")
    model = _model(ghost=False)
    real = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = lo.LightningOptimizer(real)
    assert isinstance(wrapped, torch.optim.Optimizer)  # it imitates the class it wraps
    assert unwrap_optimizer(wrapped) is real
    # Outside a Trainer a LightningOptimizer cannot step (no strategy): the real one does.
    report = _loop(model, wrapped, stepper=real)
    assert report.steps == 4
    assert [f.line() for f in report.findings if f.severity != "info"] == []


def test_plain_optimizer_is_returned_as_is() -> None:
    opt = torch.optim.SGD(_model(False).parameters(), lr=0.1)
    assert unwrap_optimizer(opt) is opt


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (Wrapper("sgd"), "optimizer is a Wrapper, not a torch.optim.Optimizer nor a wrapper"),
        (object(), "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_bad_wrappers_fail_in_one_line(bad: Any, match: str) -> None:
    with pytest.raises(gradwatch.ConfigError, match=match):
        gradwatch.watch(_model(False), bad)


def test_self_referencing_wrapper_does_not_loop() -> None:
    w = Wrapper(None)
    w.optimizer = w
    with pytest.raises(gradwatch.ConfigError, match="Wrapper"):
        gradwatch.watch(_model(False), w)
