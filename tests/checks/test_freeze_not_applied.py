"""``freeze_not_applied``: freezing flags PyTorch ignores while the module still trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _regime import DIM, LossOf, hf_train, lightning_fit, plain_loop, problems
from torch import nn

from gradwatch.checks.freeze_flag import FreezeNotApplied

ID = FreezeNotApplied.id


class Finetune(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


@pytest.mark.parametrize(
    ("attr", "value"),
    [("requires_grad", False), ("trainable", False), ("frozen", True)],
    ids=["requires_grad_attribute", "keras_trainable", "custom_frozen_flag"],
)
def test_a_flag_that_pytorch_ignores(attr: str, value: bool) -> None:
    model = Finetune()
    setattr(model.encoder, attr, value)  # model.encoder.requires_grad = False: a no-op
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = plain_loop(model, opt, steps=3)
    (f,) = report.by_check(ID)
    assert f.severity == "error" and f.module == "encoder" and f.first_step == 0
    assert f.details["attribute"] == attr
    assert f.details["layers"] == ["encoder.0", "encoder.2"]
    assert sorted(f.params) == [
        "encoder.0.bias",
        "encoder.0.weight",
        "encoder.2.bias",
        "encoder.2.weight",
    ]


def test_flag_on_a_single_parameter_owning_layer() -> None:
    model = Finetune()
    model.encoder[0].requires_grad = False
    (f,) = plain_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2).by_check(ID)
    assert f.module == "encoder.0"


def test_real_freezing_is_silent() -> None:
    model = Finetune()
    model.encoder.requires_grad_(False)  # the method: really frozen
    model.encoder.frozen = True  # a flag that agrees with the parameters
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert problems(plain_loop(model, opt)) == []
    other = Finetune()
    for p in other.encoder.parameters():
        p.requires_grad = False  # on each parameter: frozen
    other.encoder.trainable = False
    opt = torch.optim.SGD(other.head.parameters(), lr=0.1)
    assert problems(plain_loop(other, opt)) == []


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_module_freezing_by_attribute(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    net = Finetune()
    net.encoder.requires_grad = False
    (f,) = lightning_fit(net, tmp_path, validate=True).by_check(ID)
    assert f.module == "net.encoder"
    fixed = Finetune()
    fixed.encoder.requires_grad_(False)
    assert problems(lightning_fit(fixed, tmp_path, validate=True)) == []


def test_hf_trainer_freezing_by_attribute(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    net = Finetune()
    net.encoder.requires_grad = False
    model: Any = LossOf(net)
    (f,) = hf_train(model, tmp_path, evaluate=True).by_check(ID)
    assert f.module == "net.encoder"
