"""A healthy model, for ``gradwatch check examples/ci_clean.py:build`` (exits 0).

The same regressor as ``examples/ci_ghost.py``, without the unused auxiliary head.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import gradwatch


class CleanNet(nn.Module):
    """A small regressor: every layer reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def build() -> gradwatch.Probe:
    """The probe ``gradwatch check`` runs."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x[:, :1] - 0.5 * x[:, 1:2]
    model = CleanNet()
    return gradwatch.Probe(
        model=model,
        batch=(x, y),
        loss_fn=loss_fn,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    )


if __name__ == "__main__":
    # `gradwatch check examples/ci_clean.py:build` is the CI form (its exit code fails the job);
    # run as a script, this only prints the report.
    build().run(steps=3).print()
