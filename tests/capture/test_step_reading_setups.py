"""Reading arrivals at the step on other optimizers and gradient kinds (capture/grads/step_reading.py).

Each setup trains twice, with the default configuration (the step reads most arrivals after
the first steps) and with ``trim_hooks_after: null`` (every hook always on: the ground truth),
and must end with the same weights and the same findings, details included. The setups the
plain-SGD loops of ``test_step_reading.py`` do not reach: LBFGS (several backward passes per
step, inside the step), sparse embedding gradients (a new tensor on each accumulation; with
``zero_grad(set_to_none=False)`` the same tensor, which only a hook can judge), a GAN's two
optimizers sharing one backward, and a ghost whose gradient the loop fills with zeros from
the first step on.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.capture.grads.step_reading import MIN_READ

STEPS = 30
Setup = Callable[[], tuple[nn.Module, list[torch.optim.Optimizer], Callable[[int], None]]]


class Stack(nn.Module):
    """52 residual blocks (106 tensors, 108 with an embedding); ``skip``: blocks not run."""

    def __init__(self, sparse: bool = False, embed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=sparse) if embed else None
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(52))
        self.head = nn.Linear(8, 1)
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x).mean(1)
        for k, block in enumerate(self.blocks):
            if k not in self.skip:
                x = x + 0.1 * torch.tanh(block(x))
        return self.head(x)


def _batch(s: int, ids: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s % 8)
    x = torch.randint(0, 50, (16, 4), generator=g) if ids else torch.randn(16, 8, generator=g)
    return x, torch.randn(16, 1, generator=g)


def _lbfgs() -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[int], None]]:
    model = Stack()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)

    def step(s: int) -> None:
        model.skip = {7} if s >= 15 else set()
        x, y = _batch(s)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)

    return model, [opt], step


def _sparse(set_to_none: bool) -> Setup:
    def build() -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[int], None]]:
        model = Stack(sparse=True, embed=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def step(s: int) -> None:
            x, y = _batch(s, ids=True)
            opt.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        return model, [opt], step

    return build


def _gan() -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[int], None]]:
    gen, disc = Stack(), Stack()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)

    def step(s: int) -> None:
        x, real = _batch(s)
        fake = gen(x)
        opt_d.zero_grad()
        loss_d = disc(fake.detach().expand(-1, 8)).mean() - disc(real.expand(-1, 8)).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        (-disc(fake.expand(-1, 8)).mean()).backward()  # fills the critic's .grad as well
        opt_g.step()

    return nn.ModuleDict({"gen": gen, "disc": disc}), [opt_g, opt_d], step


def _zero_filled_ghost() -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[int], None]]:
    model = Stack()
    model.skip = {9}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(s: int) -> None:
        x, y = _batch(s)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # the DDP workaround that hides a ghost
        opt.step()

    return model, [opt], step


SETUPS: dict[str, tuple[Setup, str | None]] = {
    "lbfgs_late_ghost": (_lbfgs, "ghost_param"),
    "sparse_set_to_none": (_sparse(True), None),
    "sparse_zero_in_place": (_sparse(False), None),
    "gan": (_gan, None),
    "zero_filled_ghost_from_the_start": (_zero_filled_ghost, "ghost_param"),
}


def _run(build: Setup, every_hook: bool) -> tuple[set[Any], list[torch.Tensor], int]:
    torch.manual_seed(0)
    model, opts, step = build()
    config: dict[str, Any] = {"warn": False, "on_internal_error": "raise"}
    if every_hook:
        config["trim_hooks_after"] = None
    read = 0
    with gradwatch.watch(model, opts, config=config) as w:
        for s in range(STEPS):
            step(s)
            read = max(read, len(w._hooks.unhooked))
    found = {
        (f.check, f.severity, tuple(sorted(f.params)), json.dumps(f.details, sort_keys=True))
        for f in w.report().findings
    }
    return found, [p.detach().clone() for p in model.parameters()], read


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_same_findings_and_weights_as_every_hook_on(name: str) -> None:
    build, expected = SETUPS[name]
    want, want_w, never = _run(build, every_hook=True)
    have, have_w, read = _run(build, every_hook=False)
    assert never == 0
    if name == "sparse_zero_in_place":
        assert read == 0  # the same tensor each step: only a hook can tell
    else:
        assert read >= MIN_READ, "the reading never started: the comparison proves nothing"
    assert all(torch.equal(a, b) for a, b in zip(want_w, have_w))
    assert have == want
    if expected is not None:
        assert expected in {f[0] for f in have}
