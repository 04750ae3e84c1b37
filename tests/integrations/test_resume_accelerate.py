"""resume_mismatch through accelerate: the watcher registered with
``Accelerator.register_for_checkpointing`` is saved by ``save_state`` and restored by
``load_state``; a scheduler left out of ``prepare`` (so out of the checkpoint) is named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.resume_mismatch import ResumeMismatch

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def fresh() -> Iterator[Any]:
    """A factory of fresh single-process CPU Accelerators (process-wide singletons)."""
    from accelerate.state import AcceleratorState, GradientState

    def make() -> Any:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        return accelerate.Accelerator(cpu=True)

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _run(acc: Any, steps: int, folder: Path, load: bool, prepare_sched: bool = True) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    if prepare_sched:
        model, opt, sched = acc.prepare(model, opt, sched)
    else:
        model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        acc.register_for_checkpointing(w)
        if load:
            acc.load_state(str(folder))
        for _ in range(steps):
            x = torch.randn(8, 6, generator=g)
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(x), x[:, :1]))
            opt.step()
            sched.step()
        if not load:
            acc.save_state(str(folder))
    return w.report()


def _aspects(report: Any) -> set[str]:
    return {f.details["aspect"] for f in report.by_check(ResumeMismatch.id)}


def test_save_state_load_state_resume_is_silent(fresh: Any, tmp_path: Path) -> None:
    _run(fresh(), 4, tmp_path / "ck", load=False)
    report = _run(fresh(), 2, tmp_path / "ck", load=True)
    assert not report.by_check(ResumeMismatch.id), [f.line() for f in report.findings]
    assert report.steps == 6


def test_scheduler_left_out_of_prepare_restarts(fresh: Any, tmp_path: Path) -> None:
    _run(fresh(), 4, tmp_path / "ck", load=False, prepare_sched=False)
    report = _run(fresh(), 2, tmp_path / "ck", load=True, prepare_sched=False)
    assert _aspects(report) & {"scheduler", "lr"}, [f.line() for f in report.findings]
