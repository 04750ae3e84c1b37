"""The garbage collector's work is part of gradwatch's cost.

A collection of the youngest generation runs once 700 more container objects were made than
freed; what is alive then moves to an older generation, whose collections walk every object
of the process. A watcher that made its per-step references before dropping the last step's
tripped one at nearly every step on a model of 400 parameters, and moved ~90 objects a step
towards the full collections (0.25 ms a step, measured in benchmarks/breakdown.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradwatch


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(16, 16), nn.Tanh())])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.fixture
def collections_counted() -> Iterator[list[int]]:
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)


def test_steady_steps_do_not_keep_the_collector_busy(collections_counted: list[int]) -> None:
    model, opt = _model()
    with gradwatch.watch(model, opt):
        _steps(model, opt, 40)  # past the scan and the hooks' trim
        collections_counted.clear()
        _steps(model, opt, 100)
        watched = len(collections_counted)
    base_model, base_opt = _model()
    _steps(base_model, base_opt, 40)
    collections_counted.clear()
    _steps(base_model, base_opt, 100)
    plain = len(collections_counted)
    assert watched <= plain + 25, f"{watched} collections in 100 watched steps, {plain} plain"
