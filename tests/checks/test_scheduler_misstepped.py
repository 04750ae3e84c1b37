"""``scheduler_misstepped``: an LR scheduler stepped more than once per optimizer step, or
before the optimizer's first step.

Bug forms: ``scheduler.step()`` per micro-batch under accumulation, twice per step, before
``optimizer.step()``, and under Lightning a manual ``step()`` on top of Lightning's own.
Clean: OneCycle and warm-up stepped per optimizer step (also under accumulation), an epoch
schedule per epoch, a GradScaler's skipped first step, accelerate's prepared scheduler under
accumulation, and Lightning's own scheduler handling with ``accumulate_grad_batches``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR, StepLR

import gradwatch
from gradwatch.checks.scheduler_misstepped import SchedulerMisstepped

ACC = 4
MICRO = 16

Sched = Callable[[torch.optim.Optimizer], LRScheduler]


def _onecycle(o: torch.optim.Optimizer) -> LRScheduler:
    return OneCycleLR(o, max_lr=1e-2, total_steps=100)


def _warmup(o: torch.optim.Optimizer) -> LRScheduler:
    return LambdaLR(o, lambda s: min(1.0, (s + 1) / 10))


def _loop(where: str, make: Sched = _onecycle, acc: int = ACC) -> gradwatch.Report:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = make(opt)
    with warnings.catch_warnings():
        # PyTorch's own "lr_scheduler.step() before optimizer.step()" warning, for "before"
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        with gradwatch.watch(model, opt, config=CFG) as w:
            for k, (x, y) in enumerate(batches(MICRO)):
                if where == "before" and k % acc == 0:
                    sched.step()
                (nn.functional.mse_loss(model(x), y) / acc).backward()
                if where == "micro":
                    sched.step()
                if (k + 1) % acc == 0:
                    opt.step()
                    opt.zero_grad()
                    if where in ("after", "twice"):
                        sched.step()
                    if where == "twice":
                        sched.step()
                if where == "epoch" and (k + 1) % 8 == 0:
                    sched.step()
    return w.report()


@pytest.mark.parametrize(
    ("where", "steps", "first"),
    [("micro", ACC, 0), ("twice", 2, 1), ("before", 1, 0)],
)
def test_a_misstepped_scheduler_fires_once(where: str, steps: int, first: int) -> None:
    report = _loop(where, acc=1 if where == "before" else ACC)
    (f,) = report.by_check(SchedulerMisstepped.id)
    assert f.severity == "warning" and f.first_step == first
    assert f.details["scheduler_steps"] == steps, f.details
    if where == "before":  # only the first step is ahead; the schedule then keeps pace
        assert f.count == 1 and f.details["when"] == "before_first_step"
    assert fired(report) == {SchedulerMisstepped.id}, report.findings


@pytest.mark.parametrize("make", [_onecycle, _warmup], ids=["onecycle", "warmup"])
def test_per_step_and_per_epoch_schedules_are_clean(make: Sched) -> None:
    assert _loop("after", make).findings == []
    assert _loop("after", make, acc=1).findings == []
    assert _loop("epoch", lambda o: StepLR(o, 2)).findings == []


def test_a_grad_scaler_skip_still_steps_the_schedule_cleanly() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = _warmup(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        with gradwatch.watch(model, opt, config=CFG, scaler=scaler) as w:
            for k, (x, y) in enumerate(batches(6)):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y) * (float("inf") if k in (0, 3) else 1)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
    assert not w.report().by_check(SchedulerMisstepped.id), w.report().findings


def test_accelerate_prepared_scheduler_under_accumulation_is_clean() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACC)
    net = mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model, opt, sched = acc.prepare(net, opt, _onecycle(opt))
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(MICRO):
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()  # accelerate steps it only when the optimizer did
                opt.zero_grad()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    report = w.report()
    assert report.steps == MICRO // ACC and not fired(report), report.findings


def test_under_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import Regressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class Scheduled(Regressor):
        def __init__(self, extra_step: bool) -> None:
            super().__init__()
            self.extra_step = extra_step

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
            sched = {"scheduler": _warmup(opt), "interval": "step"}
            return {"optimizer": opt, "lr_scheduler": sched}

        def on_train_batch_end(self, *args: Any) -> None:
            if self.extra_step:
                self.lr_schedulers().step()  # type: ignore[union-attr]  # on top of Lightning's

    def fit(module: Any, root: Path, **kw: Any) -> gradwatch.Report:
        cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
        trainer(root, cb, **kw).fit(module, loader())
        assert cb.report is not None
        return cb.report

    late = fit(Scheduled(extra_step=True), tmp_path / "bug")
    assert fired(late) == {SchedulerMisstepped.id}, late.findings
    assert late.by_check(SchedulerMisstepped.id)[0].details["scheduler_steps"] == 2
    clean = fit(Scheduled(extra_step=False), tmp_path / "ok", accumulate_grad_batches=2)
    assert not fired(clean), clean.findings
