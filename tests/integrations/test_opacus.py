"""Opacus (DP-SGD): what ``PrivacyEngine.make_private`` returns goes to ``watch()`` as is.

``DPOptimizer`` never runs ``Optimizer.__init__``: it clips and noises the per-sample
gradients, writes ``.grad`` and steps its ``original_optimizer``, which gradwatch hooks.
``GradSampleModule`` wraps the model: findings carry the user's own parameter names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _loops import SideNet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradwatch

opacus = pytest.importorskip("opacus")

pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning"),  # fine for tests
    # Opacus's own backward hooks on the first layer (its input needs no grad), with or
    # without gradwatch.
    pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
]

STEPS = 4


def _private(use_side: bool = True, mode: str = "hooks") -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = SideNet(use_side)
    data = TensorDataset(torch.randn(STEPS * 16, 8), torch.randn(STEPS * 16, 4))
    return opacus.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )


def _epoch(model: Any, opt: Any, loader: Any) -> None:
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_clean_dp_sgd_is_silent_and_counts_every_step(mode: str) -> None:
    model, opt, loader = _private(mode=mode)
    before = [p.detach().clone() for p in model.parameters()]
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        _epoch(model, opt, loader)
    report = w.report()
    assert report.steps == STEPS and not report.findings, [f.line() for f in report.findings]
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert {layer.name for layer in report.layers} >= {"body.0", "body.2", "side"}


def test_a_ghost_opacus_refuses_is_named_in_the_report() -> None:
    """Opacus raises at the step for a parameter without a per-sample gradient, before the
    optimizer: the report says nothing was stepped, and names the parameters."""
    model, opt, loader = _private(use_side=False)
    w = gradwatch.watch(model, opt)
    with pytest.raises(ValueError, match="Per sample gradient"):
        with w:
            _epoch(model, opt, loader)
    report = w.report()
    assert report.failed and report.steps == 0
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "no_step" and f.params == ["side.weight", "side.bias"]
