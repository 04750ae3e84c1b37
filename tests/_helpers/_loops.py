"""Small real training loops shared by the check tests (no mocks: real modules and autograd)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

import gradwatch

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(n: int, dim: int = 8, out: int = 1, batch: int = 16, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, dim, generator=g), torch.randn(batch, out, generator=g))
        for _ in range(n)
    ]


def train(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    steps: int = 4,
    *,
    config: Any = None,
    dim: int = 8,
    out: int = 1,
    loss: Optional[Callable[[nn.Module, Batch], torch.Tensor]] = None,
    **watch_kw: Any,
) -> gradwatch.Report:
    """The ordinary loop: zero_grad, forward, backward, step, under ``watch()``."""
    cfg = {"every_n_steps": 1, **(config or {})}
    loss = loss or (lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    with gradwatch.watch(model, optimizer, config=cfg, **watch_kw) as w:
        for b in batches(steps, dim, out):
            if optimizer is not None:
                optimizer.zero_grad()
            loss(model, b).backward()
            if optimizer is not None:
                optimizer.step()
    return w.report()


def ghosts(report: gradwatch.Report) -> set[str]:
    return {p for f in report.by_check("ghost_param") for p in f.params}


def fired(report: gradwatch.Report, min_severity: str = "warning") -> set[str]:
    order = {"info": 0, "warning": 1, "error": 2}
    return {f.check for f in report.findings if order[f.severity] >= order[min_severity]}


def mlp(dim: int = 8, hidden: int = 16, out: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, out))


class SideNet(nn.Module):
    """An MLP ``body`` plus a ``side`` layer called only when ``use_side`` is set: otherwise
    ``side`` is a ghost (cause ``not_called``). For wrappers that must keep the user's names."""

    def __init__(self, use_side: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.side = nn.Linear(8, 4)
        self.use_side = use_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + self.side(x) if self.use_side else out
