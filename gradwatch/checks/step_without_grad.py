"""``step_without_grad``: gradients were cleared between ``backward()`` and ``step()``, or
between the micro-batches of one accumulated step (``details.discarded_backward_passes``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class StepWithoutGradConfig(CheckConfig):
    """``step_without_grad``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class StepWithoutGrad(Check):
    """Fires when a step found no gradient on any of its parameters after a backward ran."""

    id = "step_without_grad"
    maturity = "stable"
    Config = StepWithoutGradConfig
    doc = CheckDoc(
        summary="optimizer.step() ran with no gradient on any of its parameters although a "
        "backward ran since its last step.",
        why="The backward's work is thrown away: the step moves nothing (or only by weight "
        "decay and momentum), so the model does not learn.",
        causes=(
            "zero_grad() between backward() and step() (the calls in the wrong order).",
            "A helper that clears gradients (p.grad = None) before stepping.",
            "zero_grad() inside a gradient-accumulation loop (every micro-batch instead of "
            "after each step): the step uses the last micro-batch only "
            "(`details.discarded_backward_passes`).",
        ),
        fix="Order the loop as zero_grad(), forward, backward(), step(); under gradient "
        "accumulation call zero_grad() once per optimizer step, right after step().",
        detail="`zero_grad()` between `backward()` and `step()`; or `zero_grad()` inside a "
        "gradient-accumulation loop, so the step used only the last micro-batch "
        "(`details.discarded_backward_passes`; seen for `set_to_none` resets, the default; SAM, "
        "LBFGS closures, GANs, PCGrad and steps a `GradScaler` skipped are fine)",
    )
    needs = frozenset({"discarded_passes"})

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None or not view.backward_in_window or not view.ids:
            return
        if view.window.discarded_passes:
            _discarded(self, view, log)
            return
        if not any(view.arrived) or not all(
            view.cleared[k] for k, a in enumerate(view.arrived) if a
        ):
            return
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{view.optimizer_name}.step() ran with no gradient on any of its "
            "parameters although backward() ran since its previous step.",
            hint="zero_grad() runs between backward() and step(): move it before backward() "
            "(or after step()).",
            params=view.index.names([i for i, a in zip(view.ids, view.arrived) if a]),
            key=f"optimizer[{view.optimizer}]",
            details={"optimizer": view.optimizer},
        )


def _discarded(check: StepWithoutGrad, view: StepView, log: FindingLog) -> None:
    """Gradients of earlier micro-batches reset before the step that should have summed them."""
    n = view.window.discarded_passes
    log.emit(
        check.id,
        severity=check.severity,
        step=view.step,
        message=f"{view.optimizer_name}.step() used only the last backward pass's "
        f"gradient: the gradients of {n} earlier backward pass(es) since its previous step "
        "were reset (zero_grad()) before it, unused.",
        hint="zero_grad() runs inside the gradient-accumulation loop: call it once per "
        "optimizer step (after step()), not before every micro-batch's backward().",
        params=view.index.names([i for i, a in zip(view.ids, view.arrived) if a]),
        key=f"optimizer[{view.optimizer}]",
        details={"optimizer": view.optimizer, "discarded_backward_passes": n},
    )
