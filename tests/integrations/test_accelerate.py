"""accelerate: ``watch()`` on what ``Accelerator.prepare`` returns, with gradient accumulation.

``prepare`` hands back an ``AcceleratedOptimizer``: an ``Optimizer`` subclass that never ran
``Optimizer.__init__`` and skips the real step while micro-batches accumulate. gradwatch
hooks the optimizer inside, so a step is counted once per real update.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradwatch

accelerate = pytest.importorskip("accelerate")

MICRO_BATCHES = 12
ACCUMULATE = 3


class Net(nn.Module):
    def __init__(self, ghost: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
        self.ghost = nn.Linear(6, 6) if ghost else None  # built, never called: the bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.fixture
def accelerator() -> Iterator[object]:
    """A fresh single-process CPU Accelerator (its state is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(MICRO_BATCHES, 4, 6, generator=g)
    return [(x, x[:, :1] * 0.5) for x in xs]


def _train(accelerator: object, ghost: bool) -> tuple[gradwatch.Report, int]:
    torch.manual_seed(0)
    model = Net(ghost)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)  # type: ignore[attr-defined]
    assert type(opt).__name__ == "AcceleratedOptimizer"
    real_steps = 0

    def count(*_: object) -> None:
        nonlocal real_steps
        real_steps += 1

    opt.optimizer.register_step_post_hook(count)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as watcher:
        for x, y in _data():
            with accelerator.accumulate(model):  # type: ignore[attr-defined]
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)  # type: ignore[attr-defined]
                opt.step()  # skipped by accelerate until the last micro-batch of a cycle
                opt.zero_grad()  # likewise
    return watcher.report(), real_steps


def test_ghost_found_through_accelerated_optimizer(accelerator: object) -> None:
    report, real_steps = _train(accelerator, ghost=True)
    assert real_steps == MICRO_BATCHES // ACCUMULATE
    assert report.steps == real_steps  # one step per real update, not per micro-batch
    assert report.backward_passes == MICRO_BATCHES
    (ghost,) = report.by_check("ghost_param")
    assert ghost.severity == "error" and ghost.details["cause"] == "not_called"
    assert sorted(ghost.params) == ["ghost.bias", "ghost.weight"]  # the user's own names
    assert report.failed


def test_clean_twin_is_silent_and_counts_real_updates(accelerator: object) -> None:
    report, real_steps = _train(accelerator, ghost=False)
    assert report.steps == real_steps == MICRO_BATCHES // ACCUMULATE
    assert [f.line() for f in report.findings if f.severity != "info"] == []
    assert report.coverage.optimizers == 1 and report.coverage.not_in_optimizer == 0
    assert not report.failed


def test_accelerated_optimizer_without_inner_is_a_config_error(accelerator: object) -> None:
    from accelerate.optimizer import AcceleratedOptimizer

    model = Net(ghost=False)
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.optimizer = None  # type: ignore[assignment]  # a broken wrapper: nothing inside
    with pytest.raises(gradwatch.ConfigError, match=r"wraps no initialised torch\.optim"):
        gradwatch.watch(model, opt)
