"""``clipped_while_scaled``: gradients edited before ``GradScaler.unscale_``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class ClippedWhileScaledConfig(CheckConfig):
    """``clipped_while_scaled``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class ClippedWhileScaled(Check):
    """Gradients changed while still multiplied by the loss scale.

    Meaning: between the end of backward and the moment the ``GradScaler`` unscaled them
    (``scaler.unscale_(optimizer)``, or inside ``scaler.step``), gradients were modified in
    place or replaced: clipped, normalised, noised.

    Causes: ``clip_grad_norm_`` (or any gradient edit) before ``scaler.unscale_``: the clip
    threshold applies to gradients 2**16 times too large, so every step is clipped to a
    tiny update and the model barely learns (and noise is added at the wrong scale).

    Fix: call ``scaler.unscale_(optimizer)`` first, then clip, then ``scaler.step``.

    Only when a scaler is given to ``watch()``. Clipping after ``unscale_`` is correct, and
    steps the scaler skips for inf/NaN are expected. Not judged under DDP (the reducer's
    own writes look like edits to the version counter).
    """

    id = "clipped_while_scaled"
    maturity = "stable"
    Config = ClippedWhileScaledConfig
    needs = frozenset({"unscale_watch"})
    doc = CheckDoc(
        summary="Gradients were changed (clipped, normalised, noised) after backward but before "
        "`GradScaler.unscale_`/`scaler.step`, while still multiplied by the loss scale.",
        why="Clipping a scaled gradient clips at `max_norm x scale`: with a scale of 65536 it "
        "never clips, or clips wrongly as the scale changes.",
        causes=(
            "`clip_grad_norm_` called between `scaler.scale(loss).backward()` and "
            "`scaler.step(optimizer)` without `scaler.unscale_(optimizer)` first.",
        ),
        fix="Call `scaler.unscale_(optimizer)` before clipping, as the PyTorch AMP examples do.",
        detail="with a `scaler` given to `watch()`: gradients were changed (clipped, normalised, "
        "noised) after backward but before the `GradScaler` unscaled them. `unscale_` then clip "
        "is fine (not judged under DDP)",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        edits = view.window.scaled_edits
        if not edits:
            return
        names = view.index.names(edits)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"gradients of {len(names)} parameter(s) were changed (clipped, normalised "
            f"or noised) before the GradScaler unscaled them for {view.optimizer_name}: "
            "the edit acted on gradients still multiplied by the loss scale.",
            hint="Call scaler.unscale_(optimizer) before clip_grad_norm_ (or any gradient "
            "edit), then scaler.step(optimizer) and scaler.update().",
            params=names,
            key=f"optimizer[{view.optimizer}]",
            details={"optimizer": view.optimizer, "edited_params": len(names)},
        )
