"""``eval_mode_training``: training steps in eval mode, in plain loops, Lightning and HF."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _regime import DIM, EncoderDecoder, LossOf, hf_train, lightning_fit, plain_loop, problems
from torch import nn

from gradwatch.checks.eval_mode import EvalModeTraining

ID = EvalModeTraining.id


def _mlp(p: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 1)
    )


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: reads ``self.training``, has no parameters."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = (torch.rand(x.shape[0], 1) > self.p).to(x.dtype) / (1 - self.p)
        return x * keep


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.drop_path = DropPath(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.fc(x))


# -- the bug, in a plain loop ---------------------------------------------------------------


def test_validation_helper_that_never_restores_train_mode() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def validate(step: int) -> None:
        if step == 2:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, DIM))

    report = plain_loop(model, opt, after_step=validate)
    (f,) = report.by_check(ID)
    assert f.severity == "error" and f.module == "(root)"
    assert f.first_step == 3 and f.count == 5
    assert f.details["modules"] == ["1", "3"] and f.details["root"] is True
    assert f.details["last_train_step"] == 2
    assert "after step 2" in f.message


def test_model_put_in_eval_before_the_loop() -> None:
    """A checkpoint loaded and ``model.eval()`` called in a notebook cell, then training."""
    model = _mlp()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = plain_loop(model, opt, steps=3, train_first=False)
    (f,) = report.by_check(ID)
    assert f.first_step == 0 and f.details["eval_at_start"] is True
    assert "before the loop" in f.message


def test_stochastic_depth_of_a_custom_module_in_eval() -> None:
    model = nn.Sequential(Residual(), nn.ReLU(), nn.Linear(DIM, 1))
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (f,) = plain_loop(model, opt, steps=3, train_first=False).by_check(ID)
    assert f.details["modules"] == ["0.drop_path"]


def test_sampling_helper_leaves_the_decoder_in_eval() -> None:
    model = EncoderDecoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def preview(step: int) -> None:
        if step == 1:
            model.decoder.eval()  # "generate a sample" helper: never restored
            with torch.no_grad():
                model.decoder(torch.randn(1, 16))

    (f,) = plain_loop(model, opt, after_step=preview).by_check(ID)
    assert f.severity == "warning" and f.module == "decoder"
    assert f.details["modules"] == ["decoder"] and f.details["root"] is False
    assert f.details["last_train_step"] == 1
    assert sorted(f.params) == [
        "decoder.0.bias",
        "decoder.0.weight",
        "decoder.2.bias",
        "decoder.2.weight",
    ]


# -- correct look-alikes ----------------------------------------------------------------------


def test_validation_with_grad_enabled_that_restores_train_is_silent() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def validate(step: int) -> None:
        model.eval()
        model(torch.randn(4, DIM)).sum()  # no torch.no_grad: a forward in grad mode
        model.train()

    assert not plain_loop(model, opt, after_step=validate).by_check(ID)


class FrozenBNBackbone(nn.Module):
    """Detection fine-tuning: a frozen conv+BN backbone kept in eval by a train() override."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 1))
        self.train()  # Lightning >= 2.2 keeps the modes it finds (it calls no train())

    def train(self, mode: bool = True) -> FrozenBNBackbone:
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class NormEval(nn.Module):
    """mmdetection's ``norm_eval=True``: trainable BN layers put in eval one by one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)
        )

    def train(self, mode: bool = True) -> NormEval:
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Distill(nn.Module):
    """A student trained against a frozen teacher kept in eval (and an EMA-style copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = _mlp()
        self.teacher = copy.deepcopy(self.student).requires_grad_(False).eval()

    def train(self, mode: bool = True) -> Distill:
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x) + 0.0 * t


@pytest.mark.parametrize("make", [FrozenBNBackbone, NormEval, Distill], ids=lambda c: c.__name__)
def test_modules_in_eval_on_purpose_are_silent(make: Any) -> None:
    model = make()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    assert problems(plain_loop(model, opt)) == []


def test_a_model_without_mode_dependent_layers_in_eval_is_silent() -> None:
    """Eval mode changes nothing in a plain MLP: no finding."""
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1)).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert not plain_loop(model, opt, train_first=False).by_check(ID)


# -- frameworks that switch modes for you --------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_sampling_in_training_step_without_restoring(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")

    def sample(module: Any, batch_idx: int) -> None:
        if batch_idx == 1:  # "log a few samples" every N steps
            module.eval()
            with torch.no_grad():
                module(torch.randn(2, DIM))

    report = lightning_fit(_mlp(), tmp_path, on_step=sample)
    (f,) = report.by_check(ID)
    assert f.severity == "error" and f.first_step == 1 and f.details["last_train_step"] == 0


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:Found .* in eval mode at the start of training")
def test_lightning_validation_loop_switching_modes_is_silent(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    assert problems(lightning_fit(_mlp(), tmp_path, validate=True)) == []
    assert problems(lightning_fit(FrozenBNBackbone(), tmp_path, validate=True)) == []


def test_hf_compute_loss_calling_a_preview_that_leaves_eval(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def preview(model: nn.Module) -> None:  # a compute_loss override that samples first
        model.eval()
        with torch.no_grad():
            model.net(torch.randn(2, DIM))

    report = hf_train(LossOf(_mlp()), tmp_path, before_loss=preview)
    (f,) = report.by_check(ID)
    assert f.severity == "error" and f.first_step == 0 and f.count == 6


def test_hf_trainer_evaluation_switching_modes_is_silent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = hf_train(LossOf(_mlp()), tmp_path, evaluate=True)
    assert problems(report) == []
