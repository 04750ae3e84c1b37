"""``loss_input_out_of_domain``: a torch loss given values outside its documented domain.

Violating forms, as practitioners report them: a {0, 255} segmentation mask into
``BCEWithLogitsLoss``; ``KLDivLoss`` given ``softmax`` probabilities as its input
(sebastian-hofstaetter/matchmaker#18, lightly-ai/lightly#1340, baudm/MONet-pytorch#10); a
Siamese net trained with ``CosineEmbeddingLoss``/``HingeEmbeddingLoss`` on {0, 1} labels;
``NLLLoss`` on raw logits (imported as ``from torch.nn.functional import nll_loss``);
multi-hot targets into ``cross_entropy``; a loss computed inside the model's forward.
Clean twins: label smoothing, soft targets in [0, 1], mixup rows, ``kl_div`` with
``log_target=True``, distillation with a temperature, ±1 labels, ``ignore_index``, and
``nll_loss`` on ``softmax`` output (``loss_input_already_normalised``'s, reported once).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn
from torch.nn.functional import nll_loss

import gradwatch

ID = "loss_input_out_of_domain"
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _net(out: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, out)
    )


def _run(model: nn.Module, loss: Loss, target: Callable[[torch.Generator], torch.Tensor]) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for _ in range(3):
            x = torch.randn(16, 8, generator=gen)
            y = target(gen)
            opt.zero_grad()
            loss(model, x, y).backward()
            opt.step()
    assert torch._C._len_torch_function_stack() == 0  # nothing of gradwatch's left pushed
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _mask255(g: torch.Generator) -> torch.Tensor:
    return (torch.rand(16, 4, generator=g) > 0.5).float() * 255


def _labels01(g: torch.Generator) -> torch.Tensor:
    return (torch.rand(16, generator=g) > 0.5).float()


def _cls(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 4, (16,), generator=g)


def test_a_255_mask_into_bce_with_logits_names_the_target_and_the_line() -> None:
    crit = nn.BCEWithLogitsLoss()
    (f,) = _found(_run(_net(), lambda m, x, y: crit(m(x), y), _mask255))
    assert f.severity == "error" and f.details["argument"] == "target"
    assert f.details["loss_module"] == "BCEWithLogitsLoss" and f.details["observed"] == [0, 255]
    assert "test_loss_domain.py" in f.details["called_at"]
    assert f.module == "4" and set(f.params[:2]) == {
        "4.weight",
        "4.bias",
    }  # upstream, nearest first
    assert "0.weight" in f.params


def test_kldiv_given_probabilities_as_its_input() -> None:
    kl = nn.KLDivLoss(reduction="batchmean")

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return kl(m(x).softmax(-1), y.softmax(-1))  # matchmaker#18

    (f,) = _found(_run(_net(), loss, lambda g: torch.randn(16, 4, generator=g)))
    assert f.details["loss"] == "kl_div" and f.details["argument"] == "input"
    assert f.details["domain"] == "logprob"


@pytest.mark.parametrize(
    "loss",
    [
        lambda m, x, y: nn.CosineEmbeddingLoss()(m(x), m(x.flip(0)), y),
        lambda m, x, y: nn.HingeEmbeddingLoss()((m(x) - m(x.flip(0))).norm(dim=1), y),
        lambda m, x, y: F.margin_ranking_loss(m(x)[:, 0], m(x)[:, 1], y),
        lambda m, x, y: nn.SoftMarginLoss()(m(x)[:, 0], y),
    ],
)
def test_margin_losses_on_zero_one_labels(loss: Loss) -> None:
    (f,) = _found(_run(_net(), loss, _labels01))
    assert f.details["domain"] == "pm1" and f.details["argument"] == "target"


def test_nll_loss_on_raw_logits_however_imported() -> None:
    (f,) = _found(_run(_net(), lambda m, x, y: nll_loss(m(x), y), _cls))
    assert f.details["loss"] == "nll_loss" and f.details["domain"] == "logprob"


def test_multi_hot_targets_into_cross_entropy() -> None:
    def multi_hot(g: torch.Generator) -> torch.Tensor:
        t = (torch.rand(16, 4, generator=g) > 0.4).float()
        t[:, 0] = 1.0  # at least two positives in most rows
        return t

    (f,) = _found(_run(_net(), lambda m, x, y: F.cross_entropy(m(x), y), multi_hot))
    assert f.details["domain"] == "dist"


def test_negative_poisson_counts_from_standardised_targets() -> None:
    def standardised(g: torch.Generator) -> torch.Tensor:
        c = torch.poisson(torch.full((16, 4), 3.0), generator=g)
        return (c - c.mean()) / c.std()

    (f,) = _found(_run(_net(), lambda m, x, y: F.poisson_nll_loss(m(x), y), standardised))
    assert f.details["loss"] == "poisson_nll_loss" and f.details["domain"] == "nonneg"


def test_negative_class_weights_from_a_log_ratio() -> None:
    freq = torch.tensor([0.5, 0.3, 0.15, 0.05])
    weight = torch.log(freq.max() / freq) - 0.5  # meant as inverse frequency: the first < 0
    (f,) = _found(_run(_net(), lambda m, x, y: F.cross_entropy(m(x), y, weight=weight), _cls))
    assert f.details["argument"] == "weight" and f.details["domain"] == "nonneg"


class _WithLoss(nn.Module):
    """A model that computes its loss in forward, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.net(x), y)


def test_a_loss_computed_inside_the_forward() -> None:
    (f,) = _found(_run(_WithLoss(), lambda m, x, y: m(x, y), _mask255))
    assert (
        f.details["loss"] == "binary_cross_entropy_with_logits"
        and f.details["argument"] == "target"
    )


def _soft(g: torch.Generator) -> torch.Tensor:
    return torch.rand(16, 4, generator=g) * 0.8 + 0.1


def _mixup(g: torch.Generator) -> torch.Tensor:
    a, b = torch.randint(0, 4, (16,), generator=g), torch.randint(0, 4, (16,), generator=g)
    lam = 0.7
    return lam * F.one_hot(a, 4).float() + (1 - lam) * F.one_hot(b, 4).float()


def _smoothed_bf16(g: torch.Generator) -> torch.Tensor:
    t = F.one_hot(torch.randint(0, 4, (16,), generator=g), 4).float() * 0.9 + 0.1 / 4
    return t.bfloat16()  # soft targets kept in bf16: each row sums to 1 within rounding


def _ignored(g: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, 4, (16,), generator=g)
    t[::3] = -100
    return t


def _distil(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    T = 4.0
    s, t = F.log_softmax(m(x) / T, -1), F.softmax(y / T, -1)
    return F.kl_div(s, t, reduction="batchmean") * T * T


@pytest.mark.parametrize(
    ("loss", "target"),
    [
        (lambda m, x, y: nn.BCEWithLogitsLoss()(m(x), y), _soft),  # soft targets
        (lambda m, x, y: F.binary_cross_entropy(torch.sigmoid(m(x)), y), _soft),
        (lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1), _cls),
        (lambda m, x, y: F.cross_entropy(m(x), y), _mixup),
        (lambda m, x, y: F.cross_entropy(m(x).bfloat16(), y), _smoothed_bf16),
        (lambda m, x, y: F.cross_entropy(m(x), y), _ignored),
        (lambda m, x, y: F.cross_entropy(m(x), y, weight=torch.tensor([1.0, 2.0, 0.0, 4.0])), _cls),
        (lambda m, x, y: F.nll_loss(F.log_softmax(m(x), 1), y), _cls),
        (
            lambda m, x, y: F.kl_div(
                F.log_softmax(m(x), -1),
                F.log_softmax(y, -1),
                log_target=True,
                reduction="batchmean",
            ),
            lambda g: torch.randn(16, 4, generator=g),
        ),
        (_distil, lambda g: torch.randn(16, 4, generator=g)),
        (lambda m, x, y: nn.CosineEmbeddingLoss()(m(x), m(x.flip(0)), 2 * y - 1), _labels01),
        (
            lambda m, x, y: F.poisson_nll_loss(m(x), y),
            lambda g: torch.poisson(torch.full((16, 4), 3.0), generator=g),
        ),
        (
            lambda m, x, y: F.multilabel_soft_margin_loss(m(x), y),
            lambda g: (torch.rand(16, 4, generator=g) > 0.5).float(),
        ),
    ],
)
def test_losses_given_their_domain_are_silent(loss: Loss, target: Any) -> None:
    assert not _found(_run(_net(), loss, target))


def test_nll_on_softmax_is_the_normalised_check_alone() -> None:
    report = _run(_net(), lambda m, x, y: F.nll_loss(F.softmax(m(x), 1), y), _cls)
    assert not _found(report)
    assert [f.check for f in report.findings if f.check == "loss_input_already_normalised"]


def test_only_scan_steps_are_read_and_a_users_mode_is_left_alone() -> None:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.BCEWithLogitsLoss()
    cfg = {**CFG, "checks": {ID: {"scan_steps": 2}}}
    with gradwatch.watch(model, opt, config=cfg) as w:
        for k in range(4):
            x, y = torch.randn(16, 8), _mask255(torch.Generator().manual_seed(k))
            opt.zero_grad()
            with Count():  # the user's own mode: gradwatch pushes nothing under it
                out = model(x)
            crit(out, y).backward()
            opt.step()
    assert torch._C._len_torch_function_stack() == 0
    assert not _found(w.report())
