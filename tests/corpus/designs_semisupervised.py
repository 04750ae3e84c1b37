"""Canonical self- and semi-supervised designs with a stop-gradient or a confidence mask:
BYOL, SimSiam, FixMatch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen
from _harness import Built, Program
from torch import nn


def _views(n: int, bs: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = gen(seed)
    out = []
    for _ in range(n):
        x = torch.randn(bs, 16, generator=g)
        out.append(tuple(x + 0.2 * torch.randn(bs, 16, generator=g) for _ in range(2)))
    return out  # type: ignore[return-value]


def _mlp(d_in: int, h: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, d_out))


class BYOLOnline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.projector = _mlp(16, 32, 16), _mlp(16, 32, 8)
        self.predictor = _mlp(8, 32, 8)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.project(x))


def _regression(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return 2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1).mean()


def _byol() -> Built:
    online = BYOLOnline()
    target = copy.deepcopy(online)  # Grill et al. 2020: the target is an EMA of the online net
    for p in target.parameters():
        p.requires_grad = False
    opt = torch.optim.Adam(online.parameters(), lr=3e-4, weight_decay=1e-6)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        v1, v2 = batch
        with torch.no_grad():
            t1, t2 = target.project(v1), target.project(v2)
        loss = _regression(model(v1), t2) + _regression(model(v2), t1)  # symmetrised
        opt.zero_grad()
        loss.backward()
        opt.step()
        tau = 0.996
        with torch.no_grad():
            for pt, po in zip(target.parameters(), model.parameters()):
                pt.mul_(tau).add_(po, alpha=1 - tau)

    return Built(online, opt, _views(4, 16, 60), step)


class SimSiam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(_mlp(16, 32, 16), nn.BatchNorm1d(16))
        self.predictor = _mlp(16, 8, 16)  # the bottleneck predictor

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z1, z2 = self.encoder(x1), self.encoder(x2)
        return self.predictor(z1), self.predictor(z2), z1.detach(), z2.detach()


def _simsiam_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    p1, p2, z1, z2 = model(*batch)  # facebookresearch/simsiam main_simsiam.py
    return -(F.cosine_similarity(p1, z2).mean() + F.cosine_similarity(p2, z1).mean()) * 0.5


def _simsiam() -> Built:
    model = SimSiam()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _simsiam_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, _views(4, 16, 61), step, _simsiam_loss, probe_optimizer=opt)


def _fixmatch() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, nesterov=True)
    threshold, lambda_u, mu = 0.95, 1.0, 2
    g = gen(62)
    batches = []
    for x, y in classes(4, 8, 16, 4, seed=62):
        u = torch.randn(mu * 8, 16, generator=g)
        weak = u + 0.05 * torch.randn(u.shape, generator=g)
        strong = u * (torch.rand(u.shape, generator=g) > 0.3).float() + 0.3 * torch.randn(
            u.shape, generator=g
        )
        batches.append((x, y, weak, strong))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y, u_weak, u_strong = batch  # kekmodel/FixMatch-pytorch train.py (interleaved forward)
        logits = model(torch.cat([x, u_weak, u_strong]))
        logits_x = logits[: x.size(0)]
        logits_w, logits_s = logits[x.size(0) :].chunk(2)
        lx = F.cross_entropy(logits_x, y)
        probs = logits_w.detach().softmax(-1)
        max_probs, targets_u = probs.max(-1)
        mask = max_probs.ge(threshold).float()  # confident pseudo-labels only: none at first
        lu = (F.cross_entropy(logits_s, targets_u, reduction="none") * mask).mean()
        loss = lx + lambda_u * lu
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Built(model, opt, batches, step)


PROGRAMS = [
    Program("byol_ema_target", "contrastive", _byol,
            "Grill et al. 2020 BYOL (predictor, stop-gradient, EMA target)"),
    Program("simsiam_stop_gradient", "contrastive", _simsiam,
            "Chen & He 2021 SimSiam; facebookresearch/simsiam (stop-gradient, negative cosine)"),
    Program("fixmatch_confidence_mask", "semi-supervised", _fixmatch,
            "Sohn et al. 2020 FixMatch; kekmodel/FixMatch-pytorch (threshold 0.95, mu unlabeled)"),
]  # fmt: skip
