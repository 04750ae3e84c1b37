"""``frozen_stats_updated`` judges the statistics, not the mode at the forward's start.

Look-alikes that are correct: the model is in train mode when its forward starts, but the
forward itself puts the frozen sub-network in eval before calling it, so its running
statistics never change (checked: exactly equal). A perceptual loss's feature extractor, a
distillation teacher inside the model, and a detector that applies ``norm_eval`` at the top
of its forward. And the converse, which the mode at the start hides: frozen batch norms kept
in eval by a ``train()`` override that the forward switches back to train.
"""

from __future__ import annotations

import torch
from _regime import DIM, plain_loop, problems
from torch import nn

from gradwatch.checks.frozen_stats import FrozenStatsUpdated

ID = FrozenStatsUpdated.id


def _features() -> nn.Sequential:
    """A small pretrained-style feature extractor with batch norms, frozen."""
    net = nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16)
    )
    return net.requires_grad_(False)


class PerceptualLoss(nn.Module):
    """A generator trained against a frozen feature extractor's features (as in SRGAN/LPIPS)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, DIM))
        self.vgg = _features()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.vgg.eval()  # the loss network is always used in eval
        return self.head(self.vgg(self.generator(x)))


class Distiller(nn.Module):
    """A student and a frozen teacher in one module; the teacher is put in eval per call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))
        self.teacher = nn.Sequential(_features(), nn.Linear(16, 1).requires_grad_(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.teacher.train(False)
        with torch.no_grad():
            soft = self.teacher(x)
        return self.student(x) + 0.0 * soft


class NormEvalDetector(nn.Module):
    """mmdet-style ``norm_eval``, applied at the top of ``forward`` instead of in ``train()``."""

    def __init__(self, norm_eval: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm_eval = norm_eval
        self.backbone = _features()
        self.neck = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_eval:
            for m in self.backbone.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self.head(torch.relu(self.neck(self.backbone(x))))


def _bn_stats(model: nn.Module) -> list[torch.Tensor]:
    return [
        t.clone()
        for m in model.modules()
        if isinstance(m, nn.BatchNorm1d)
        for t in (m.running_mean, m.running_var)
        if t is not None
    ]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _unchanged_and_silent(model: nn.Module) -> None:
    before = _bn_stats(model)
    report = plain_loop(model, torch.optim.SGD(_trainable(model), lr=0.01), steps=5)
    after = _bn_stats(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # exactly 0.0 change
    assert not report.by_check(ID), problems(report)
    assert problems(report) == []


def test_a_perceptual_loss_network_put_in_eval_inside_forward_is_silent() -> None:
    _unchanged_and_silent(PerceptualLoss())


def test_a_teacher_put_in_eval_inside_forward_is_silent() -> None:
    _unchanged_and_silent(Distiller())


def test_norm_eval_applied_in_forward_is_silent() -> None:
    _unchanged_and_silent(NormEvalDetector())


def test_frozen_norms_switched_back_to_train_inside_forward_fire() -> None:
    class KeptEvalThenTrained(NormEvalDetector):
        def train(self, mode: bool = True) -> KeptEvalThenTrained:
            super().train(mode)
            self.backbone.eval()  # the fix, in train() ...
            return self

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.backbone.train()  # ... undone by the forward
            return super().forward(x)

    model = KeptEvalThenTrained(norm_eval=False)
    report = plain_loop(model, torch.optim.SGD(_trainable(model), lr=0.01), steps=4)
    (f,) = report.by_check(ID)
    assert f.details["modules"] == ["backbone.1", "backbone.4"]
    assert f.count == 3  # the first flagged step waits for a second look (EMA targets)
