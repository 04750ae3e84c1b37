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
from pathlib import Path
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


@pytest.fixture
def self_restoring_handler() -> Iterator[None]:
    """A handler that puts the default back before it raises, as many job scripts do: when
    its exception is judged, it is no longer the installed handler."""

    def handler(signum: int, frame: Optional[FrameType]) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise Preempted(f"signal {signum}")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("place", PLACES)
def test_a_handler_that_uninstalled_itself_still_stops_the_loop(
    place: str, self_restoring_handler: None
) -> None:
    arm = _Arm(place)
    stopped, report, done = _train(arm)
    assert arm.fired, f"{place} never ran"
    assert isinstance(stopped, Preempted), f"the loop went on ({done} steps): {report.findings}"
    assert not report.by_check("internal_error")


def test_a_run_interrupted_inside_its_first_step_is_not_observed(tmp_path: Path) -> None:
    """Ctrl-C between ``optimizer.step()``'s call and its end: no step was judged, and the
    file says so instead of reading as clean."""
    path = tmp_path / "r.json"

    def interrupt(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "after_step":
            sys.setprofile(None)
            raise KeyboardInterrupt

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyboardInterrupt):
        with gradwatch.watch(model, opt, config={"report_path": str(path), "warn": False}):
            x, y = batches(1)[0]
            nn.functional.mse_loss(model(x), y).backward()
            sys.setprofile(interrupt)
            try:
                opt.step()
            finally:
                sys.setprofile(None)
    saved = gradwatch.Report.read(path)
    assert saved.steps == 0 and saved.failed
    assert [f.details["reason"] for f in saved.by_check("not_observed")] == ["no_step"]


_STORM_SCRIPT = """
import signal, sys, torch, gradwatch
# A terminal's Ctrl-C: Python keeps SIGINT ignored when it starts ignored (pytest run as a
# background job), and the storm would then stop nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
from torch import nn
torch.set_num_threads(1)
m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
with gradwatch.watch(m, opt, config={"report_path": sys.argv[1], "warn": False, "console": False}):
    print("ready", flush=True)
    for i in range(10**6):
        opt.zero_grad()
        nn.functional.mse_loss(m(torch.randn(16, 32)), torch.randn(16, 1)).backward()
        opt.step()
"""


@pytest.mark.slow
def test_a_ctrl_c_storm_always_leaves_a_truthful_report(tmp_path: Path) -> None:
    """Eight SIGINTs in a burst, at a random point of the run, six times: every run leaves
    its final report (the steps it ran, or ``not_observed``), never none or a stale refresh."""
    import json
    import random
    import subprocess
    import time

    script = tmp_path / "train.py"
    script.write_text(_STORM_SCRIPT)
    rng = random.Random(0)
    outcomes = []
    for k in range(6):
        path = tmp_path / f"r{k}.json"
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.3))
        for _ in range(8):
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGINT)
            time.sleep(rng.uniform(0.0, 0.01))
        _, err = proc.communicate(timeout=120)
        assert "KeyboardInterrupt" in err
        assert path.exists(), f"run {k} left no report: {err[-500:]}"
        data = json.loads(path.read_text())
        observed = [f["check"] for f in data["findings"] if f["check"] == "not_observed"]
        outcomes.append((data["steps"], data["failed"]))
        assert data["steps"] > 0 or (data["failed"] and observed), (k, data["findings"])
        # the final write, not a refresh left standing: its backward passes match its steps
        assert data["backward_passes"] >= data["steps"]
    print(f"storm: 6 runs, 6 truthful reports; steps {sorted(s for s, _ in outcomes)}")
