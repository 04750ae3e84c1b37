"""A model with a ghost layer, for ``gradwatch check examples/ci_ghost.py:build`` (exits 1).

``aux_head`` is built in ``__init__`` but ``forward`` never calls it: its parameters sit in
the optimizer and never get a gradient. ``gradwatch check`` names them with cause
``not_called``. ``examples/ci_clean.py`` is the same model without the ghost.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import gradwatch


class GhostNet(nn.Module):
    """A small regressor whose auxiliary head is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.aux_head = nn.Linear(32, 4)  # the ghost: forward() forgets it

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
    model = GhostNet()
    return gradwatch.Probe(
        model=model,
        batch=(x, y),
        loss_fn=loss_fn,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    )


if __name__ == "__main__":
    # `gradwatch check examples/ci_ghost.py:build` is the CI form (its exit code fails the job);
    # run as a script, this only prints the report.
    build().run(steps=3).print()
