"""``step_without_grad``: gradients were cleared between ``backward()`` and ``step()``."""

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
    Config = StepWithoutGradConfig
    doc = CheckDoc(
        summary="optimizer.step() ran with no gradient on any of its parameters although a "
        "backward ran since its last step.",
        why="The backward's work is thrown away: the step moves nothing (or only by weight "
        "decay and momentum), so the model does not learn.",
        causes=(
            "zero_grad() between backward() and step() (the calls in the wrong order).",
            "A helper that clears gradients (p.grad = None) before stepping.",
        ),
        fix="Order the loop as zero_grad(), forward, backward(), step().",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None or not view.backward_in_window or not view.ids:
            return
        if not any(view.arrived) or not all(
            view.cleared[k] for k, a in enumerate(view.arrived) if a
        ):
            return
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"optimizer[{view.optimizer}].step() ran with no gradient on any of its "
            "parameters although backward() ran since its previous step.",
            hint="zero_grad() runs between backward() and step(): move it before backward() "
            "(or after step()).",
            params=view.index.names([i for i, a in zip(view.ids, view.arrived) if a]),
            key=f"optimizer[{view.optimizer}]",
            details={"optimizer": view.optimizer},
        )
