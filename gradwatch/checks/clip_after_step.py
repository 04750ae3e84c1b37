"""``clip_after_step``: gradients edited after the optimizer step that consumed them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class ClipAfterStepConfig(CheckConfig):
    """``clip_after_step``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class ClipAfterStep(Check):
    """Gradients were clipped, scaled or noised after the step that used them.

    Meaning: between ``optimizer.step()`` and the reset of the gradients it consumed
    (``optimizer.zero_grad()``), with no backward pass in between, a ``.grad`` was changed
    in place or replaced: the clip (or noise, or scaling) acted on no update at all, so the
    run trains unclipped (or without its privacy noise) while the code reads as if it did.

    Seen at the optimizer's own ``zero_grad`` (one attribute on the optimizer instance);
    gradients reset by ``model.zero_grad()`` or ``p.grad = None`` are not judged.
    """

    id = "clip_after_step"
    maturity = "stable"
    Config = ClipAfterStepConfig
    needs = frozenset({"zero_grad_watch"})
    doc = CheckDoc(
        summary="Gradients were changed (clipped, scaled, noised) after the optimizer step "
        "that consumed them and before they were cleared: the change had no effect on any "
        "update.",
        why="The step already applied the raw gradients: clipping them afterwards protects "
        "nothing (a spike goes through unclipped), and noise or a rescale added there never "
        "reaches the weights.",
        causes=(
            "`clip_grad_norm_`/`clip_grad_value_` placed after `optimizer.step()` instead "
            "of between `backward()` and `step()`.",
            "Noise for differential privacy, or a gradient rescale, added after the step.",
            "A gradient edit in a hook that runs too late: an optimizer step post hook, or "
            "an `on_after_optimizer_step`-style callback.",
        ),
        fix="Edit gradients between `loss.backward()` and `optimizer.step()` (with a "
        "GradScaler, after `scaler.unscale_(optimizer)`).",
        detail="gradients were changed (clipped, scaled, noised, replaced) after the optimizer "
        "step that consumed them and before its `zero_grad()` cleared them, with no backward in "
        "between: `clip_grad_norm_` after `step()`, DP noise added too late, a step post hook "
        "that clips. Seen at the optimizer's own `zero_grad` (one attribute on the optimizer "
        "instance, removed on exit); resets by `model.zero_grad()` or `p.grad = None` are not "
        "judged. `details.edited_params`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        edited = view.window.edited_after_step
        if not edited or view.optimizer is None:
            return
        names = view.index.names(edited)
        consumed = max(view.step - 1, 0)
        log.emit(
            self.id,
            severity=self.severity,
            step=consumed,
            message=f"gradients of {len(names)} parameter(s) were changed (clipped, scaled or "
            f"noised) after {view.optimizer_name}.step() had consumed them and before "
            "zero_grad() cleared them: the change had no effect on any update.",
            hint="Move the gradient edit (clip_grad_norm_, noise, rescale) between "
            "loss.backward() and optimizer.step().",
            params=names,
            key=f"optimizer[{view.optimizer}]",
            details={"optimizer": view.optimizer, "edited_params": len(names)},
        )
