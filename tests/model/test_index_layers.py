"""A layer is the module that owns parameters, a parametrization's ``original`` included."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrizations

import gradwatch


def test_a_parametrized_weight_belongs_to_its_module_with_the_bias() -> None:
    """Spectral norm keeps the weight under ``2.parametrizations.weight.original``: the layer
    is ``2`` (its bias and its weight together), so a hinge GAN's last bias, whose gradient
    cancels exactly while the weight learns, is not a layer gone dead."""
    torch.manual_seed(0)
    disc = nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(4, 16)),
        nn.LeakyReLU(0.2),
        parametrizations.spectral_norm(nn.Linear(16, 1)),
    )
    opt = torch.optim.Adam(disc.parameters(), lr=1e-4, betas=(0.0, 0.9))
    with gradwatch.watch(disc, opt, config={"warn": False, "every_n_steps": 1}) as w:
        for _ in range(5):
            real, fake = torch.randn(8, 4) + 3, torch.randn(8, 4) - 3
            opt.zero_grad()
            # hinge loss with every margin active: d/d(last bias) = -1 + 1 = 0 exactly
            loss = torch.relu(1 - disc(real)).mean() + torch.relu(1 + disc(fake)).mean()
            loss.backward()
            opt.step()
    report = w.report()
    layers = {row.name: set(row.params) for row in report.layers}
    assert layers["2"] == {"2.bias", "2.parametrizations.weight.original"}
    assert not report.by_check("dead_param")
