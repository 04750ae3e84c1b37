"""``loss_input_already_normalised``: probabilities into a loss that normalises its input.

Bug forms, as practitioners report them: an image classifier whose forward ends in
``nn.Softmax`` trained with ``nn.CrossEntropyLoss`` (the PyTorch-forum classic), a
segmentation head with ``Softmax(dim=1)`` into a per-pixel ``cross_entropy``, a multi-label
head ending in ``torch.sigmoid`` into ``BCEWithLogitsLoss``, and a REINFORCE policy whose
``-log pi(a)`` is taken by ``nll_loss`` on probabilities. Clean: ``log_softmax`` + ``nll_loss``,
``log(softmax)`` + ``nll_loss``, label smoothing on logits, ``sigmoid`` + ``BCELoss``, soft
targets, and a softmax kept for inference only.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch
from gradwatch.checks.registry import ALL_CHECKS

ID = "loss_input_already_normalised"
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Classifier(nn.Module):
    def __init__(self, softmax: bool, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.fc = nn.Linear(16, classes)
        self.softmax = nn.Softmax(dim=1) if softmax else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.fc(self.body(x)))


class SegHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.cls = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.cls(torch.relu(self.conv(x))), dim=1)


class MultiLabel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(x))


def _run(model: nn.Module, loss_fn: Loss, make: Callable[[int], tuple[Any, Any]]) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(4):
            x, y = make(k)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return w.report()


def _cls(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)


def _seg(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 4, (2, 8, 8), generator=g)


def _multi(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(16, 8, generator=g), (torch.rand(16, 6, generator=g) > 0.5).float()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def test_softmax_module_into_cross_entropy_names_the_module() -> None:
    ce = nn.CrossEntropyLoss()
    report = _run(Classifier(softmax=True), lambda m, x, y: ce(m(x), y), _cls)
    (f,) = _found(report)
    assert f.severity == "error" and f.module == "softmax"
    assert f.details["loss"].startswith("cross_entropy") and f.details["input"] == "softmax"
    assert "test_loss_normalised.py" in (f.details["backward_at"] or "")


def test_segmentation_softmax_into_pixelwise_cross_entropy() -> None:
    report = _run(SegHead(), lambda m, x, y: F.cross_entropy(m(x), y), _seg)
    (f,) = _found(report)
    assert f.module == "SegHead" and f.details["shape"] == [2, 4, 8, 8]


def test_sigmoid_into_bce_with_logits() -> None:
    bce = nn.BCEWithLogitsLoss()
    report = _run(MultiLabel(), lambda m, x, y: bce(m(x), y), _multi)
    (f,) = _found(report)
    assert f.details["input"] == "sigmoid" and "BCEWithLogits" in f.details["loss"]


def test_policy_nll_on_probabilities() -> None:
    """REINFORCE with ``nll_loss(probs, actions)`` weighted by returns: ``-pi(a)``, not
    ``-log pi(a)``; the softmax is in the loss code, so the layer whose output it took is named."""
    policy = Classifier(softmax=False, classes=4)

    def loss(m: nn.Module, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(m(x), dim=-1)
        return (F.nll_loss(probs, a % 4, reduction="none") * torch.ones(16)).mean()

    (f,) = _found(_run(policy, loss, _cls))
    assert f.details["loss"] == "nll_loss" and f.module == "fc"


@pytest.mark.parametrize(
    "loss",
    [
        pytest.param(lambda m, x, y: F.nll_loss(F.log_softmax(m(x), 1), y), id="log_softmax_nll"),
        pytest.param(lambda m, x, y: F.nll_loss(torch.log(m(x).softmax(1) + 1e-8), y), id="log"),
        pytest.param(lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1), id="smooth"),
        pytest.param(
            lambda m, x, y: F.cross_entropy(m(x), F.one_hot(y, 5).float() * 0.9 + 0.02),
            id="soft_targets",
        ),
        pytest.param(
            lambda m, x, y: F.binary_cross_entropy(torch.sigmoid(m(x)), F.one_hot(y, 5).float()),
            id="sigmoid_bce",
        ),
        pytest.param(
            lambda m, x, y: F.cross_entropy(m(x), y) + 0.0 * m(x).softmax(1).max(),
            id="softmax_for_metrics",
        ),
    ],
)
def test_look_alikes_are_silent(loss: Loss) -> None:
    assert not _found(_run(Classifier(softmax=False), loss, _cls))


def test_distillation_softmax_target_is_silent() -> None:
    """KD: ``kl_div(log_softmax(student), softmax(teacher))``: the softmax is the target."""
    teacher, student = Classifier(softmax=False), Classifier(softmax=False)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x)
        kd = F.kl_div(F.log_softmax(m(x) / 2, 1), F.softmax(t / 2, 1), reduction="batchmean")
        return kd + F.cross_entropy(m(x), y)

    assert not _found(_run(student, loss, _cls))


def test_nothing_is_described_after_the_scan_steps() -> None:
    scanners = [c.id for c in ALL_CHECKS if c.needs & {"loss_graph", "loss_terms"}]
    cfg = {**CFG, "checks": {c: {"scan_steps": 2} for c in scanners}}
    model = Classifier(softmax=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=cfg) as w:
        for k in range(5):
            x, y = _cls(k)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    (f,) = _found(w.report())
    assert f.count == 2  # seen on the two scan steps only
