"""``frozen_param_updated`` when the frozen set changes at every step.

A loop that freezes, at each step, the paths it skips (``requires_grad_(False)``) and keeps
``zero_grad(set_to_none=False)`` leaves zero gradients on them: SGD's momentum and weight
decay still move the "frozen" weights every step (0.002 to 0.02 per step here). Three forms:
two branches taken in turn, an encoder and a decoder trained in turn by one optimizer, and a
one-shot NAS supernet that samples one candidate op per step.

Each step's freeze is a layout change; the frozen set must be fingerprinted after it,
before the step (it was seen only after the step, and the step went unjudged). The finding
names the cause: the optimizer's momentum, its weight decay, or both (``details.causes``).
"""

from __future__ import annotations

from typing import Callable

import torch
from _loops import batches
from torch import nn

import gradwatch

Choose = Callable[[int, nn.Module], None]


class TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.path = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.a(x) if self.path == 0 else self.b(x)))


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class Supernet(nn.Module):
    """One-shot NAS: three candidate ops per cell, one sampled per step."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.ops = nn.ModuleList(
            [
                nn.Linear(8, 8),
                nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 8)),
                nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)),
            ]
        )
        self.head = nn.Linear(8, 1)
        self.choice = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.ops[self.choice](self.stem(x))))


def _branch(k: int, m: nn.Module) -> None:
    m.path = k % 2
    m.a.requires_grad_(m.path == 0)
    m.b.requires_grad_(m.path == 1)


def _alternate(k: int, m: nn.Module) -> None:
    m.encoder.requires_grad_(k % 2 == 0)
    m.decoder.requires_grad_(k % 2 == 1)


_CHOICES = [0, 1, 2, 1, 0, 2, 0, 1]  # as a seeded sampler drew them: a new op every step


def _sample(k: int, m: nn.Module) -> None:
    m.choice = _CHOICES[k]
    for j, op in enumerate(m.ops):
        op.requires_grad_(j == m.choice)


def _run(model: nn.Module, choose: Choose, opt: torch.optim.Optimizer) -> gradwatch.Report:
    torch.manual_seed(0)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(8)):
            choose(k, model)
            opt.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def _causes(report: gradwatch.Report) -> set[tuple[str, ...]]:
    return {tuple(f.details["causes"]) for f in report.by_check("frozen_param_updated")}


def _moved(report: gradwatch.Report) -> set[str]:
    return {f.module or "" for f in report.by_check("frozen_param_updated")}


def test_the_branch_skipped_in_turn_moves_by_momentum() -> None:
    torch.manual_seed(0)
    model = TwoBranch()
    report = _run(model, _branch, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    assert _moved(report) == {"a", "b"}, [f.line() for f in report.findings]
    assert all(f.severity == "error" for f in report.by_check("frozen_param_updated"))
    assert _causes(report) == {("momentum",)}
    assert (
        "SGD's momentum (0.9) still moves them"
        in report.by_check("frozen_param_updated")[0].message
    )


def test_encoder_and_decoder_trained_in_turn_move_by_weight_decay() -> None:
    torch.manual_seed(0)
    model = EncDec()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.1)
    report = _run(model, _alternate, opt)
    assert _moved(report) == {"encoder.0", "encoder.2", "decoder.0", "decoder.2"}
    assert _causes(report) == {("weight_decay",)}
    assert (
        "weight decay (0.1) still moves them" in report.by_check("frozen_param_updated")[0].message
    )


def test_supernet_ops_not_sampled_move_by_momentum_and_decay() -> None:
    torch.manual_seed(0)
    model = Supernet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    report = _run(model, _sample, opt)
    assert {"ops.0", "ops.1.0", "ops.2.1"} <= _moved(report), [f.line() for f in report.findings]
    assert _causes(report) == {("momentum", "weight_decay")}
    f = report.by_check("frozen_param_updated")[0]
    assert "SGD's momentum (0.9) and weight decay (0.01) still move them" in f.message


def test_adam_with_several_groups_of_one_kind_names_both_causes() -> None:
    torch.manual_seed(0)
    model = TwoBranch()
    opt = torch.optim.AdamW(
        [{"params": [*model.a.parameters(), *model.b.parameters()]},
         {"params": model.out.parameters()}],
        lr=1e-2,
    )  # fmt: skip
    report = _run(model, _branch, opt)
    assert _moved(report) == {"a", "b"}
    assert _causes(report) == {("momentum", "weight_decay")}
    assert "AdamW's moving averages" in report.by_check("frozen_param_updated")[0].message
