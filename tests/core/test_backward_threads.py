"""Backward passes run by several threads at once are each counted once (issue 44.7).

Four threads each run a backward pass per step (a data-parallel loop by hand, as the
``torch.nn.parallel.parallel_apply`` style does): the gradients of their graph tasks arrive
interleaved, and each pass must still end once.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import gradwatch

THREADS, STEPS = 4, 20


def test_four_threads_doing_backward_each_step_count_four_passes_per_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    errors: list[BaseException] = []

    def work(x: torch.Tensor) -> None:
        try:
            model(x).pow(2).mean().backward()
        except BaseException as exc:  # a thread's error must fail the test, not vanish
            errors.append(exc)

    with gradwatch.watch(model, opt) as w:
        for _ in range(STEPS):
            opt.zero_grad()
            threads = [
                threading.Thread(target=work, args=(torch.randn(64, 32),)) for _ in range(THREADS)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            opt.step()
    report = w.report()
    assert not errors
    assert (report.steps, report.backward_passes) == (STEPS, THREADS * STEPS)
    assert not report.by_check("internal_error")
