"""A signal handler's exception is the user's: fault containment never swallows it.

A job's SIGTERM handler that raises ``Preempted`` (or ``signal.alarm``'s ``TimeoutError``)
runs in whichever Python frame the main thread is in, and during ``backward()`` or
``optimizer.step()`` that is mostly gradwatch's hooks. The exception must stop the loop as it
does without gradwatch, not become an ``internal_error`` while training goes on.

The signal is raised at a chosen gradwatch function through ``sys.setprofile``: the handler
then runs there, as a real signal landing in that function would, on every run.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional

import pytest
import torch
from _loops import batches, mlp
from torch import nn

import gradwatch

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")

STEPS = 6
ARM_AT = 2


class Preempted(Exception):
    """What a cluster job's SIGTERM handler raises."""


class _Arm:
    """Raises SIGUSR1 once, when the main thread enters function ``name`` (of gradwatch's,
    or the test sink's, which gradwatch calls)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        ours = "gradwatch" in code.co_filename or code.co_filename == __file__
        if event == "call" and code.co_name == self.name and ours:
            sys.setprofile(None)
            self.fired = True
            signal.raise_signal(signal.SIGUSR1)


@pytest.fixture
def preempting_handler() -> Iterator[None]:
    def handler(signum: int, frame: Optional[FrameType]) -> None:
        raise Preempted(f"signal {signum}")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGUSR1, previous)


class _Sink:
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass


def _train(arm: _Arm) -> tuple[Optional[BaseException], gradwatch.Report, int]:
    """The ordinary loop, the signal armed at step ``ARM_AT``; (what stopped it, report, steps)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = 0
    stopped: Optional[BaseException] = None
    watcher = gradwatch.watch(model, opt, config={"every_n_steps": 1}, sinks=[_Sink()])
    try:
        with watcher:
            for i, (x, y) in enumerate(batches(STEPS)):
                if i == ARM_AT:
                    sys.setprofile(arm)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                done += 1
    except Preempted as exc:
        stopped = exc
    finally:
        sys.setprofile(None)
    return stopped, watcher.report(), done


# Places inside gradwatch's guarded code: the optimizer step hook (the pipeline's step and a
# check judging it), the end of backward, a gradient's arrival in a parameter hook, a sink.
PLACES = ["step_post", "after_step", "backward_end", "on_arrival", "log_metrics"]


@pytest.mark.parametrize("place", PLACES)
def test_a_signal_handlers_exception_stops_the_loop(place: str, preempting_handler: None) -> None:
    arm = _Arm(place)
    stopped, report, done = _train(arm)
    assert arm.fired, f"{place} never ran"
    assert isinstance(stopped, Preempted), f"the loop went on ({done} steps): {report.findings}"
    assert done == ARM_AT  # stopped in the step the signal came in, as without gradwatch
    assert not report.by_check("internal_error")


def test_the_watcher_is_closed_after_the_signal(preempting_handler: None) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Preempted):
        with gradwatch.watch(model, opt) as watcher:
            x, y = batches(1)[0]
            nn.functional.mse_loss(model(x), y).backward()
            sys.setprofile(_Arm("step_post"))
            opt.step()
    # Every hook is gone: the next watcher may watch the model, training works unwatched.
    assert not (model[0].weight._post_accumulate_grad_hooks or {})
    with gradwatch.watch(model, opt):
        pass
    del watcher


def test_an_ordinary_fault_is_still_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a signal: an exception of gradwatch's own code is an internal_error, as before."""
    import gradwatch.core.steps

    def boom(self: Any, k: int) -> None:
        raise RuntimeError("a gradwatch bug")

    monkeypatch.setattr(gradwatch.core.steps.StepPipeline, "after_step", boom)
    stopped, report, done = _train(_Arm("never called"))
    assert stopped is None and done == STEPS
    assert report.by_check("internal_error")
