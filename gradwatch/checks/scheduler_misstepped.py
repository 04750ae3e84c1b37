"""``scheduler_misstepped``: an LR scheduler stepped more often than its optimizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class SchedulerMissteppedConfig(CheckConfig):
    """``scheduler_misstepped``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


class SchedulerMisstepped(Check):
    """A scheduler attached to a watched optimizer stepped more than once per optimizer step,
    or before the optimizer's first step.

    Read from the scheduler's own counter (``last_epoch``) at each step of its optimizer: no
    hook, no patch. Schedulers stepped per optimizer step (warm-up, OneCycle) or per epoch
    are fine, as are the extra steps of a step the GradScaler skipped and accelerate's one
    step per process.
    """

    id = "scheduler_misstepped"
    maturity = "stable"
    Config = SchedulerMissteppedConfig
    needs = frozenset({"scheduler_counts"})
    doc = CheckDoc(
        summary="A learning-rate scheduler attached to a watched optimizer stepped more than "
        "once per optimizer step, or before the optimizer's first step: the schedule runs "
        "at the wrong speed.",
        why="A warm-up meant for 1,000 steps ends after 250 under 4-step accumulation; a "
        "cosine or OneCycle schedule reaches its end early and trains the rest at the final "
        "(often zero) learning rate. Nothing fails: the run is just worse.",
        causes=(
            "`scheduler.step()` inside the gradient-accumulation loop (per micro-batch) "
            "instead of after `optimizer.step()`.",
            "`scheduler.step()` called twice per iteration (in the loop and in a helper or "
            "callback).",
            "`scheduler.step()` before `optimizer.step()` (the schedule starts one step "
            "ahead; PyTorch warns once).",
        ),
        fix="Call `scheduler.step()` once right after each `optimizer.step()` (per-step "
        "schedules) or once per epoch (epoch schedules).",
        detail="a learning-rate scheduler built on a watched optimizer stepped more than once per "
        "optimizer step (per micro-batch under accumulation, twice per iteration) or before its "
        "first step, so the schedule runs ahead. Read from the scheduler's own counter at each "
        "optimizer step (found once from the optimizer's referrers; no hook, no patch). Per-step "
        "(warm-up, OneCycle) and per-epoch schedules, GradScaler-skipped steps and accelerate's "
        "prepared schedulers are fine. `details.scheduler_steps`, `details.when`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None or not view.window.scheduler_steps:
            return
        allowed = view.window.scheduler_allowed
        for n, before in view.window.scheduler_steps:
            if before and n >= allowed:  # more than the skipped steps' share
                said = f"stepped {n} time(s) before {view.optimizer_name}'s first step"
            elif n > allowed:
                said = f"stepped {n} times during one step of {view.optimizer_name}"
            else:
                continue
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"a learning-rate scheduler of {view.optimizer_name} {said}: "
                "the schedule runs ahead of the training steps.",
                hint="Call scheduler.step() once after each optimizer.step() (not per "
                "micro-batch under gradient accumulation, not before the step), or once per "
                "epoch for an epoch schedule.",
                params=view.index.names(view.ids),  # the scheduled optimizer's
                key=f"optimizer[{view.optimizer}]",
                details={
                    "optimizer": view.optimizer,
                    "scheduler_steps": n,
                    "when": "before_first_step" if before else "per_optimizer_step",
                },
            )
            return
