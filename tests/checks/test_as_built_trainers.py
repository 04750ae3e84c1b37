"""The model-as-built checks under the Lightning and HF Trainers: the Trainers' own groupings
and clipping are silent, and a bug the user built into the model is caught through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _regime import DIM, LossOf, hf_train, lightning_fit
from torch import nn

from gradwatch.checks.clip_without_effect import ClipWithoutEffect
from gradwatch.checks.decay_excluded import DecayOnExcludedParams
from gradwatch.checks.optimizer_hparams import OptimizerHparamsDegenerate
from gradwatch.checks.shared_module import SharedModule
from gradwatch.checks.symmetric_units import SymmetricUnits
from gradwatch.checks.tie_broken import TieBroken

SIX = {
    c.id
    for c in (
        SharedModule,
        TieBroken,
        SymmetricUnits,
        OptimizerHparamsDegenerate,
        DecayOnExcludedParams,
        ClipWithoutEffect,
    )
}


class Encoder(nn.Module):
    """DIM -> 1 with a LayerNorm and biases (what a Trainer's no-decay grouping sees)."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = nn.Linear(16, 16)
        self.inp = nn.Linear(DIM, 16)
        self.norm = nn.LayerNorm(16)
        self.blocks = nn.ModuleList(
            [block] * 2 if shared else [nn.Linear(16, 16) for _ in range(2)]
        )
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def _six(report) -> list[str]:  # type: ignore[no-untyped-def]
    return [f.line() for f in report.findings if f.check in SIX]


@pytest.mark.floor
def test_hf_trainer_grouping_and_clipping_are_silent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    report = hf_train(LossOf(Encoder()), tmp_path, weight_decay=0.1, max_grad_norm=1.0)
    assert _six(report) == []


@pytest.mark.floor
def test_hf_trainer_names_a_shared_module(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    report = hf_train(LossOf(Encoder(shared=True)), tmp_path, weight_decay=0.1)
    assert [f.details["paths"] for f in report.by_check(SharedModule.id)] == [
        ["net.blocks.0", "net.blocks.1"]
    ]


@pytest.mark.floor
def test_lightning_configure_optimizers_and_clipping_are_silent(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    report = lightning_fit(Encoder(), tmp_path, gradient_clip_val=0.5)
    assert _six(report) == []


@pytest.mark.floor
def test_lightning_names_a_shared_module(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    report = lightning_fit(Encoder(shared=True), tmp_path)
    assert len(report.by_check(SharedModule.id)) == 1
