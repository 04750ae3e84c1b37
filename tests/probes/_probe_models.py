"""Small models for the probe tests: the bugs the probes exist for, and their look-alikes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradwatch


class Swish(torch.autograd.Function):
    """A hand-fused swish whose backward forgot the product rule's second term."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x)  # d/dx x*s(x) = s(x) + x s(x)(1 - s(x))


def data(n: int = 16, d: int = 4, classes: int = 10, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def ce(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def mlp(d: int = 4, h: int = 32, out: int = 10, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, out))


def verdicts(report: gradwatch.Report) -> dict[str, str]:
    return {p.id: p.verdict for p in report.probes}


def only(check: str) -> dict[str, Any]:
    """A config that runs one probe, a preview one at its own severity (``preview: true``:
    ``gradient_mismatch`` is preview this round, SPEC 8.1)."""
    from gradwatch.probes import PROBES

    return {"preview": True, "checks": {i: {"enabled": i == check} for i in PROBES}}


def findings(report: gradwatch.Report, check: str) -> list[gradwatch.Finding]:
    return [f for f in report.findings if f.check == check]
