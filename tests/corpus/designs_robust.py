"""Canonical adversarial designs: PGD adversarial training, fast FGSM training, a universal
perturbation trained against a frozen classifier under an eps budget."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import images
from _harness import Built, Program
from torch import nn


def _cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4),
    )  # fmt: skip


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def pgd(model: nn.Module, x: Any, y: Any, eps: float, alpha: float, steps: int) -> torch.Tensor:
    """Madry et al. 2018: random start in the L-inf ball, signed-gradient ascent, projection."""
    delta = torch.empty_like(x).uniform_(-eps, eps).requires_grad_(True)
    for _ in range(steps):
        loss = F.cross_entropy(model(x + delta), y)
        (grad,) = torch.autograd.grad(loss, delta)
        delta = (delta + alpha * grad.sign()).clamp(-eps, eps).detach().requires_grad_(True)
    return (x + delta).detach()


def _pgd_training() -> Built:
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        model.eval()  # the attack sees the model as it is evaluated (Rice et al. 2020's code)
        x_adv = pgd(model, x, y, eps=0.3, alpha=0.1, steps=3)
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(x_adv), y).backward()
        opt.step()

    return Built(model, opt, images(4, 16, 4, seed=20), step, _ce, probe_optimizer=opt)


def _fast_fgsm() -> Built:
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    eps, alpha = 0.3, 0.375

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch  # Wong et al. 2020 "Fast is better than free": FGSM from a random start
        delta = torch.empty_like(x).uniform_(-eps, eps).requires_grad_(True)
        loss = F.cross_entropy(model(x + delta), y)
        loss.backward()
        delta = (delta + alpha * delta.grad.sign()).clamp(-eps, eps).detach()
        opt.zero_grad()  # the attack's backward also wrote into the weights' .grad
        F.cross_entropy(model(x + delta), y).backward()
        opt.step()

    return Built(model, opt, images(4, 16, 4, seed=21), step, _ce, probe_optimizer=opt)


class UniversalPerturbation(nn.Module):
    """One perturbation for every input, against a frozen classifier (Shafahi et al. 2020)."""

    def __init__(self, classifier: nn.Module, shape: tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.classifier, self.eps = classifier, eps
        self.delta = nn.Parameter(torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x + self.delta)


def _universal() -> Built:
    classifier = _cnn()
    c_opt = torch.optim.Adam(classifier.parameters(), lr=1e-2)
    for x, y in images(20, 32, 4, seed=22):  # the classifier under attack, trained first
        c_opt.zero_grad()
        F.cross_entropy(classifier(x), y).backward()
        c_opt.step()
    classifier.eval().requires_grad_(False)
    attack = UniversalPerturbation(classifier, (1, 3, 8, 8), eps=0.5)
    opt = torch.optim.Adam([attack.delta], lr=0.05)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return -F.cross_entropy(model(batch[0]), batch[1])  # maximise the classifier's loss

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
        with torch.no_grad():
            model.delta.clamp_(-model.eps, model.eps)  # project onto the eps budget

    return Built(attack, opt, images(4, 16, 4, seed=23), step, loss_fn, probe_optimizer=opt)


PROGRAMS = [
    Program("pgd_adversarial_training", "adversarial training", _pgd_training,
            "Madry et al. 2018 PGD adversarial training (L-inf, random start)"),
    Program("fast_fgsm_training", "adversarial training", _fast_fgsm,
            "Wong et al. 2020 Fast is better than free (FGSM with random init)"),
    Program("universal_perturbation", "universal perturbation", _universal,
            "Moosavi-Dezfooli et al. 2017; Shafahi et al. 2020 universal perturbation by SGD"),
]  # fmt: skip
