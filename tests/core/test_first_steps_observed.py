"""The first steps of a run are all observed (issue 29): statistics checks fire within ~5."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch
from gradwatch.checks.dead import DeadParam
from gradwatch.checks.stale import StaleParam
from gradwatch.core.steps import FIRST_OBSERVED


def _five_steps(model: nn.Module, opt: torch.optim.Optimizer) -> gradwatch.Report:
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt) as w:  # the default config: every_n_steps=10
        for _ in range(5):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def test_a_dead_layer_and_an_lr_zero_group_are_found_in_a_five_step_probe() -> None:
    assert FIRST_OBSERVED >= 3  # the layer checks' default patience
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].bias.fill_(-50.0)  # every ReLU unit dead: layer 0 gets exactly zero
    opt = torch.optim.SGD(
        [
            {"params": [*model[0].parameters(), *model[3].parameters()], "lr": 0.1},
            {"params": model[2].parameters(), "lr": 0.0},  # a scheduler left at 0
        ]
    )
    report = _five_steps(model, opt)
    (dead,) = [f for f in report.by_check(DeadParam.id) if f.severity == "warning"]
    assert dead.module == "0" and dead.first_step == 2
    stale = report.by_check(StaleParam.id)
    assert [f.details.get("cause") for f in stale] == ["lr_zero"] and stale[0].first_step == 2


def test_the_layer_rows_keep_the_cadence() -> None:
    """The first steps feed the checks; the report's layer history keeps every_n_steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    report = _five_steps(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert report.findings == []
    assert all(len(layer.history) == 1 for layer in report.layers)  # step 0 only
