"""``symmetric_units``: units of a weight that start equal and stay equal."""

from __future__ import annotations

import pytest
import torch
from _built import DIM, fit, of
from torch import nn

from gradwatch.checks.symmetric_units import SymmetricUnits
from gradwatch.measure.rows import duplicate_rows

ID = SymmetricUnits.id


def _constant_tanh() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 0.1)
            nn.init.zeros_(m.bias)
    return model


def _zero_sigmoid() -> nn.Module:
    model = nn.Sequential(nn.Linear(DIM, 32), nn.Sigmoid(), nn.Linear(32, 2))
    for p in model.parameters():  # "start from zero": weights and biases
        nn.init.zeros_(p)
    return model


class ConstantCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)
        for layer in (self.conv, self.fc):  # a constant "init" of every layer
            nn.init.constant_(layer.weight, 0.05)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img = x.reshape(-1, 1, 2, 4)
        return self.fc(torch.relu(self.conv(img)).mean((2, 3)))


@pytest.mark.parametrize(
    ("build", "weights"),
    [
        (_constant_tanh, {"0.weight", "2.weight"}),
        (_zero_sigmoid, {"0.weight"}),
        (ConstantCNN, {"conv.weight"}),
    ],
)
def test_units_equal_at_both_looks_are_named(build, weights) -> None:  # type: ignore[no-untyped-def]
    model = build()
    found = of(fit(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=6), ID)
    assert {f.params[0] for f in found} == weights
    assert all(f.details["distinct"] == 1 for f in found)


class ZeroHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)
        nn.init.zeros_(self.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class FixupBlock(nn.Module):
    """A residual branch whose last layer is zero-initialised (Fixup / zero_init_residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, 16)
        self.branch = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        nn.init.zeros_(self.branch[2].weight)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.norm(h + self.branch(h)))


class LoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, 2)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(DIM, 4, bias=False)
        self.lora_b = nn.Linear(4, 2, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class IdleLoRA(nn.Module):
    """peft's LoRA on a layer whose output feeds a ReLU: B starts at zero, and B's rows for the
    outputs the frozen base never fires get no gradient, so they stay zero: idle, not equal
    units (the corpus's ``lora_peft``)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, 8)
        with torch.no_grad():
            self.base.bias[:3] = -100.0  # three outputs never fire behind the ReLU
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(DIM, 4, bias=False)
        self.lora_b = nn.Linear(4, 8, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.lora_b(self.lora_a(x))))


@pytest.mark.parametrize("build", [ZeroHead, FixupBlock, LoRA, IdleLoRA])
def test_symmetry_broken_by_training_is_silent(build) -> None:  # type: ignore[no-untyped-def]
    model = build()
    params = [p for p in model.parameters() if p.requires_grad]
    assert not of(fit(model, torch.optim.AdamW(params, lr=1e-3)), ID)


def test_a_weight_that_did_not_move_is_no_evidence() -> None:
    """lr 0 on the constant layers: nothing moved, nothing is judged."""
    model = _constant_tanh()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    assert not of(fit(model, opt), ID)


def test_nothing_is_read_after_the_second_look() -> None:
    model = _constant_tanh()
    report = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=12)
    assert all(f.count == 1 for f in of(report, ID))


def test_distinct_units_of_a_wide_layer_never_collide() -> None:
    """A LLaMA MLP's width (11,008 units), default init: the float32 projections of distinct
    rows collided by rounding in 5 of these 10 draws (a false ``symmetric_units``)."""
    torch.manual_seed(0)
    weights = [nn.Linear(256, 11008).weight.detach() for _ in range(10)]
    assert duplicate_rows(weights)[:, 0].tolist() == [0.0] * 10
    twin = weights[0].clone()
    twin[7] = twin[3]  # and a real duplicate is still counted
    assert duplicate_rows([twin])[0, 0].item() == 1.0
