"""``step_without_grad`` and a backward meant for the input (FGSM adversarial training).

Fast adversarial training (Wong et al. 2020, locuslab/fast_adversarial ``train_fgsm.py``):
the attack's ``loss.backward()`` is for ``delta.grad``; it also fills the weights' ``.grad``,
which ``opt.zero_grad()`` clears before the training backward, by design. The attack's
forward had an input that requires grad: the evidence that its backward was the input's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gradwatch

EPS, ALPHA = 0.1, 0.125


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _run(zero_grad_between_micro_batches: bool) -> gradwatch.Report:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for k in range(6):
            x, y = _data(k)
            delta = torch.empty_like(x).uniform_(-EPS, EPS).requires_grad_(True)
            F.cross_entropy(model(x + delta), y).backward()  # for delta.grad
            delta = (delta + ALPHA * delta.grad.sign()).clamp(-EPS, EPS).detach()
            opt.zero_grad()
            if zero_grad_between_micro_batches:  # the bug: accumulation reset midway
                F.cross_entropy(model(x), y).backward()
                opt.zero_grad()
            F.cross_entropy(model(x + delta), y).backward()
            opt.step()
    return w.report()


def test_fgsm_training_is_silent() -> None:
    report = _run(zero_grad_between_micro_batches=False)
    assert not report.by_check("step_without_grad"), report.by_check("step_without_grad")


def test_a_training_micro_batch_reset_beside_the_attack_still_fires() -> None:
    (found,) = _run(zero_grad_between_micro_batches=True).by_check("step_without_grad")
    assert found.severity == "error"
    assert found.details["discarded_backward_passes"] >= 1
