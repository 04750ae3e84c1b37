"""``missing_zero_grad``: a step consumed gradients left over from before the previous step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class MissingZeroGradConfig(CheckConfig):
    """``missing_zero_grad``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class MissingZeroGrad(Check):
    """Fires when ``optimizer.step()`` used a gradient that still held old contributions."""

    id = "missing_zero_grad"
    maturity = "stable"
    Config = MissingZeroGradConfig
    doc = CheckDoc(
        summary="optimizer.step() consumed a gradient that still held contributions from before "
        "the parameter's previous step.",
        why="Gradients pile up across steps: the effective learning rate grows every step and "
        "old batches keep pushing the weights, which looks like instability or slow learning.",
        causes=(
            "optimizer.zero_grad() missing from the loop, or called for another optimizer.",
            "zero_grad() called once per epoch instead of once per step.",
        ),
        fix="Call optimizer.zero_grad() once per optimizer step (after step(), or before the "
        "backward of the next step). Gradient accumulation over several backward passes per "
        "step is correct and does not fire this check.",
        detail="`step()` consumed a gradient still holding contributions from before that "
        "parameter's previous step. Accumulation, GAN loops, LBFGS closures, `retain_graph`, "
        "clipping, `GradScaler.unscale_`, `zero_grad(set_to_none=False)`, `p.grad = None`, "
        "`p.grad.data.zero_()` are all fine",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None or not any(view.dirty):
            return
        stale = [view.ids[k] for k, d in enumerate(view.dirty) if d]
        names = view.index.names(stale)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{view.optimizer_name}.step() used gradients of {len(names)} parameter(s) "
            "that still held contributions from before its previous step (zero_grad missing?).",
            hint="Call optimizer.zero_grad() once per optimizer step (after step(), or before the "
            "first backward of the next step); with gradient accumulation zero after each step().",
            params=names,
            key=f"optimizer[{view.optimizer}]",
            details={"optimizer": view.optimizer},
        )
