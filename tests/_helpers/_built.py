"""Shared loops for the model-as-built checks (SPEC section 7, source 1)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

import gradwatch

DIM = 8


def fit(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int = 6,
    *,
    out: int = 2,
    between: Optional[Callable[[], Any]] = None,
    loss: Optional[Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    config: Optional[dict[str, Any]] = None,
) -> gradwatch.Report:
    """zero_grad / forward / backward / ``between()`` / step under watch(), on fixed data."""
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config=config) as w:
        for _ in range(steps):
            x = torch.randn(16, DIM, generator=gen)
            y = torch.randn(16, out, generator=gen)
            opt.zero_grad()
            value = loss(model, x, y) if loss else nn.functional.mse_loss(model(x), y)
            value.backward()
            if between is not None:
                between()
            opt.step()
    return w.report()


def of(report: gradwatch.Report, check: str) -> list[Any]:
    return report.by_check(check)
