"""``double_backward``: the same loss graph backpropagated twice into one step's gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks._grouping import by_subtree, label
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class DoubleBackwardConfig(CheckConfig):
    """``double_backward``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class DoubleBackward(Check):
    """One loss graph (the same root) backpropagated more than once into one step.

    Told from the gradient of one small parameter per optimizer: two backward passes of the
    same forward whose gradients there are bit-for-bit equal are the same root twice (two
    different losses over one graph give different ones). Non-deterministic GPU kernels can
    make a repeat differ in its last bits: then it is not seen, never falsely reported.
    """

    id = "double_backward"
    maturity = "stable"
    Config = DoubleBackwardConfig
    needs = frozenset({"backward_probe"})
    doc = CheckDoc(
        summary="The same loss graph (the same root) was backpropagated more than once into "
        "one step's gradients (`retain_graph=True` on a repeated `backward()`), so the step "
        "used a multiple of the gradient.",
        why="The step's gradient is 2x (or more) what the loss gives: an effective learning "
        "rate doubled, gradient clipping and norms off by the same factor, and nothing fails.",
        causes=(
            "A helper that calls `loss.backward(retain_graph=True)` and a loop that calls "
            "`loss.backward()` again on the same loss.",
            "A backward for logging (gradient norms) followed by the training backward, with "
            "no `zero_grad()` between them.",
            "Lightning automatic optimization: `training_step` calls `loss.backward("
            "retain_graph=True)` itself and returns the loss, which Lightning backpropagates "
            "again.",
        ),
        fix="Call `backward()` once per loss per step; to combine losses, sum them first or "
        "back-propagate each different loss once.",
        detail="the same loss graph (the same root) was backpropagated more than once into one "
        "step's gradients (`retain_graph=True` and a repeated `backward()`: a helper and the loop "
        "both calling it, a logging backward without `zero_grad()` before the training one). Told "
        "from one small parameter per optimizer: a tensor hook queues its incoming gradient's sum "
        "and norm per backward (two tiny device ops), compared at the step in its one transfer; "
        "passes of one forward with bit-equal gradients are the same root. Two different losses "
        "over one graph, SAM, gradient penalties and truncated BPTT are fine; a repeat that "
        "non-deterministic GPU kernels change in its last bits is missed, never invented. "
        "`details.repeated_backward_passes`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        n = view.window.repeated_backward
        if not n or view.optimizer is None:
            return
        # The parameters the window's gradients reached: the repeated loss's graph (and any
        # other loss backpropagated into the same step), grouped by the highest module whose
        # parameters all got it (a frozen backbone the loss never reached is not the head).
        reached = [i for i, a in zip(view.ids, view.arrived) if a]
        model = [info.idx for info in view.index.params if not info.outside_model]
        groups = by_subtree(view.index, reached, model)
        where = ", ".join(label(m) for m in list(groups)[:3])
        more = f" and {len(groups) - 3} more" if len(groups) > 3 else ""
        one = next(iter(groups)) if len(groups) == 1 else None
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"the same loss was backpropagated {n + 1} times into the gradients of "
            f"{view.optimizer_name}.step() (retain_graph=True and a repeated backward()): "
            f"{len(reached)} parameter(s) of {where}{more} got {n + 1}x their gradient.",
            hint="Call backward() once per loss: remove the repeated call (a helper that "
            "already calls it, a logging backward), or zero_grad() between them.",
            params=view.index.names(reached),
            module=one or None,
            key=f"optimizer[{view.optimizer}]",
            details={
                "optimizer": view.optimizer,
                "repeated_backward_passes": n,
                "modules": list(groups),
            },
        )
