"""``optimizer_hparams_degenerate``: hyperparameters that make an optimizer another one."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from _built import DIM, fit, of
from torch import nn

from gradwatch.checks.optimizer_hparams import OptimizerHparamsDegenerate

ID = OptimizerHparamsDegenerate.id
Make = Callable[[Any], torch.optim.Optimizer]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize(
    ("make", "hparam"),
    [
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.1, 0.001)), "betas"),  # 1 - beta
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.999, 0.9)), "betas"),  # swapped
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-1), "eps"),  # a TF recipe's eps
        (lambda ps: torch.optim.NAdam(ps, lr=1e-3, eps=1.0), "eps"),
    ],
)
def test_degenerate_hyperparameters_name_group_and_hparam(make: Make, hparam: str) -> None:
    model = _model()
    found = of(fit(model, make(model.parameters()), steps=8), ID)
    assert [f.details["hparam"] for f in found] == [hparam], found
    assert found[0].details["group"] == 0
    assert found[0].details["optimizer"] == "optimizer[0]"


def test_one_group_of_two_is_named() -> None:
    model = _model()
    opt = torch.optim.Adam(
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "betas": (0.1, 0.01)},
        ],
        lr=1e-3,
    )
    found = of(fit(model, opt), ID)
    assert [(f.details["group"], f.details["hparam"]) for f in found] == [(1, "betas")]


class Lion(torch.optim.Optimizer):
    """An optimizer gradwatch does not know, with betas of its own convention."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def _adafactor(params: Any) -> torch.optim.Optimizer:
    """transformers' Adafactor: no betas, its own state (exp_avg_sq_row/col): not judged."""
    transformers = pytest.importorskip("transformers")
    return transformers.optimization.Adafactor(params, lr=1e-3, relative_step=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95)),  # GPT
        lambda ps: torch.optim.Adam(ps, lr=2e-4, betas=(0.5, 0.999)),  # DCGAN
        lambda ps: torch.optim.Adam(ps, lr=1e-4, betas=(0.0, 0.9)),  # WGAN-GP
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        lambda ps: Lion(ps, betas=(0.95, 0.98)),
        lambda ps: _adafactor(ps),
    ],
)
def test_recipes_in_use_are_silent(make: Make) -> None:
    model = _model()
    assert not of(fit(model, make(model.parameters()), steps=8), ID)


def test_eps_is_judged_from_the_measured_moments_not_a_number() -> None:
    """eps = 1e-3 is degenerate on gradients of 1e-6, fine on gradients of order 1."""

    def tiny(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 1e-6 * nn.functional.mse_loss(m(x), y)

    def large(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 100.0 * nn.functional.mse_loss(m(x), y)

    model = _model()
    assert of(fit(model, torch.optim.Adam(model.parameters(), eps=1e-3), steps=8, loss=tiny), ID)
    model = _model()
    assert not of(
        fit(model, torch.optim.Adam(model.parameters(), eps=1e-3), steps=8, loss=large), ID
    )
