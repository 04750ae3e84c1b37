"""``step_without_grad`` on the PyTorch examples' DCGAN, each half watched by its own watcher.

The generator's backward passes through the discriminator, and ``netD.zero_grad()`` discards
those gradients at the next iteration, by design: ``optimizerG.step()`` stepped on the
parameters that backward reached before the reset, so they were its loss's. Correct: two
watchers (``with watch(netD, optD), watch(netG, optG):``) and one over ``{"G": .., "D": ..}``.
Bug forms still caught: ``netG.zero_grad()`` between the generator's backward and its step
(under either layout), and ``zero_grad()`` inside an accumulation loop next to a GAN
watched apart.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest
import torch
from _check_loops import CFG
from torch import nn

import gradwatch

ID = "step_without_grad"
NZ = 8


def _dcgan() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    g = nn.Sequential(
        nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False),
        nn.Tanh(),
    )
    d = nn.Sequential(
        nn.Conv2d(1, 16, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False),
        nn.Sigmoid(),
    )
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return g, d, opt_g, opt_d


def _train(layout: str, bug: bool = False) -> list[Any]:
    """examples/dcgan/main.py's loop, a few iterations; the findings of every watcher."""
    net_g, net_d, opt_g, opt_d = _dcgan()
    criterion = nn.BCELoss()
    with ExitStack() as stack:
        if layout == "apart":
            watchers = [
                stack.enter_context(gradwatch.watch(net_d, opt_d, config=CFG)),
                stack.enter_context(gradwatch.watch(net_g, opt_g, config=CFG)),
            ]
        else:
            models, opts = {"G": net_g, "D": net_d}, {"G": opt_g, "D": opt_d}
            watchers = [stack.enter_context(gradwatch.watch(models, opts, config=CFG))]
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            real = torch.randn(8, 1, 8, 8, generator=gen)
            net_d.zero_grad()  # (1) update D: real, then fake
            label = torch.full((8,), 1.0)
            criterion(net_d(real).view(-1), label).backward()
            fake = net_g(torch.randn(8, NZ, 1, 1, generator=gen))
            label.fill_(0.0)
            criterion(net_d(fake.detach()).view(-1), label).backward()
            opt_d.step()
            net_g.zero_grad()  # (2) update G: its backward goes through D
            label.fill_(1.0)
            criterion(net_d(fake).view(-1), label).backward()
            if bug:
                net_g.zero_grad()  # the bug: between backward and step
            opt_g.step()
    return [f for w in watchers for f in w.report().findings if f.check == ID]


@pytest.mark.parametrize("layout", ["apart", "together"])
def test_dcgan_discarding_the_generators_gradient_on_d_is_silent(layout: str) -> None:
    assert _train(layout) == []


@pytest.mark.parametrize("layout", ["apart", "together"])
def test_dcgan_zero_grad_between_backward_and_step_still_fires(layout: str) -> None:
    found = _train(layout, bug=True)
    assert any(f.severity == "error" and "no gradient" in f.message for f in found)


def test_accumulation_reset_next_to_a_gan_watched_apart_still_fires() -> None:
    """Another optimizer steps every iteration, but never between the accumulated backward
    passes and their reset: each dropped micro-batch is still told."""
    torch.manual_seed(0)
    model, other = nn.Linear(8, 1), nn.Linear(8, 1)
    opt, opt_other = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, other))
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(8):
            x = torch.randn(4, 8)
            opt.zero_grad()  # the bug: inside the accumulation loop
            (model(x).pow(2).mean() / 2).backward()
            if k % 2:
                opt.step()
                other(x).pow(2).mean().backward()  # a second model, its own optimizer
                opt_other.step()
                opt_other.zero_grad()
    found = [f for f in w.report().findings if f.check == ID]
    assert found and found[0].details["discarded_backward_passes"] == 1
