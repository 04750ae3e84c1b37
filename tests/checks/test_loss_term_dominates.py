"""``loss_term_dominates``: one term of a summed loss drowns the others on the shared trunk.

Bug forms, as practitioners report them: a detector's box regression in pixels next to its
classification loss, a VAE whose reconstruction is summed over pixels next to a KL averaged
over the batch, a depth + segmentation multitask model with depth in millimetres. Clean:
balanced terms, an auxiliary term scaled on purpose (``0.01 * aux``), Kendall's uncertainty
weighting, a single loss, a GradScaler's scaled loss, gradient accumulation.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch

ID = "loss_term_dominates"
N = 16


class TwoHeads(nn.Module):
    def __init__(self, a: int = 4, b: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head_a = nn.Linear(32, a)
        self.head_b = nn.Linear(32, b)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head_a(h), self.head_b(h)


Loss = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]


def _run(model: nn.Module, loss: Loss, steps: int = 5, accumulate: int = 1, **cfg: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with gradwatch.watch(model, opt, config={**CFG, **cfg}) as w:
        for k in range(steps * accumulate):
            x = torch.randn(N, 8, generator=torch.Generator().manual_seed(k))
            (loss(model, x, k) / accumulate).backward()
            if (k + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _labels(k: int) -> torch.Tensor:
    return torch.arange(N).add(k).remainder(4)


def _detector(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    logits, boxes = m(x)
    target_boxes = torch.rand(N, 4, generator=torch.Generator().manual_seed(k)) * 640  # pixels
    return F.cross_entropy(logits, _labels(k)) + F.mse_loss(boxes, target_boxes)


def test_box_regression_in_pixels_drowns_classification() -> None:
    (f,) = _found(_run(TwoHeads(), _detector))
    assert f.severity == "warning" and f.details["dominant"] == "mse_loss (head_b)"
    assert f.details["share"][1] > 0.98 and f.module == "head_b"


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(784, 16)  # MNIST's 28 x 28 pixels
        self.dec = nn.Linear(8, 784)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return torch.sigmoid(self.dec(z)), mu, logvar


def test_vae_summed_reconstruction_drowns_batch_mean_kl() -> None:
    torch.manual_seed(0)  # the VAE's init and its sampling draw on the global RNG

    def loss(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        # pixels in [0, 1] as ToTensor gives them (in 0..255 the KL's exp overflows at once)
        img = torch.rand(N, 784, generator=torch.Generator().manual_seed(k))
        recon, mu, logvar = m(img)
        rec = F.mse_loss(recon, img, reduction="sum")
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        return rec + kl

    (f,) = _found(_run(VAE(), loss))
    assert f.details["dominant"].startswith("mse_loss")


def test_depth_in_millimetres_next_to_segmentation() -> None:
    def loss(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        seg, depth = m(x)
        depth_mm = torch.rand(N, 1, generator=torch.Generator().manual_seed(k)) * 5000
        return F.cross_entropy(seg, _labels(k)) + F.mse_loss(depth, depth_mm)

    (f,) = _found(_run(TwoHeads(b=1), loss))
    assert f.details["terms"] == ["cross_entropy (head_a)", "mse_loss (head_b)"]


def _balanced(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    logits, boxes = m(x)
    return F.cross_entropy(logits, _labels(k)) + F.l1_loss(boxes, torch.rand(N, 4))


class Kendall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = TwoHeads()
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x)


def test_balanced_scaled_and_learned_weights_are_silent() -> None:
    assert not _found(_run(TwoHeads(), _balanced))

    def scaled(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        logits, boxes = m(x)
        aux = F.mse_loss(boxes, torch.rand(N, 4))
        return F.cross_entropy(logits, _labels(k)) + 0.001 * aux  # drowned by its own weight

    assert not _found(_run(TwoHeads(), scaled))

    def kendall(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        logits, boxes = m(x)
        ce, l1 = F.cross_entropy(logits, _labels(k)), F.mse_loss(boxes, torch.rand(N, 4) * 640)
        s = m.get_parameter("log_vars")
        return torch.exp(-s[0]) * ce + s[0] + torch.exp(-s[1]) * l1 + s[1]

    assert not _found(_run(Kendall(), kendall))


def test_consistency_term_at_its_optimum_at_the_start_is_silent() -> None:
    """Mean teacher / RLHF's KL to the reference: the second term starts at exactly zero."""
    import copy

    student = TwoHeads()
    teacher = copy.deepcopy(student).requires_grad_(False)

    def loss(m: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        logits, boxes = m(x)
        t_logits, _ = teacher(x)
        kl = F.kl_div(
            F.log_softmax(logits, 1),
            F.log_softmax(t_logits, 1),
            log_target=True,
            reduction="batchmean",
        )
        return F.mse_loss(boxes, torch.rand(N, 4) * 640) + kl

    assert not _found(_run(student, loss))


def test_accumulated_and_scaled_losses_are_still_judged_per_term() -> None:
    """``loss / k`` (accumulation) and ``loss * scale`` (a GradScaler) wrap the whole sum."""
    (f,) = _found(_run(TwoHeads(), _detector, accumulate=2))
    assert f.details["steps"] >= 3
    assert _found(_run(TwoHeads(), lambda m, x, k: _detector(m, x, k) * 1024.0))
