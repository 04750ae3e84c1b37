"""``clip_without_effect``: a gradient clipping call that saw no gradient, so clipped nothing.

``clip_grad_norm_(params, 1.0)`` with ``params = filter(...)`` or a generator already read
by the optimizer's constructor gets an empty list: it clips nothing, every step, and only
an empty *generator* makes torch warn. The evidence (``clip_calls``,
:mod:`gradwatch.capture.loop.clip_calls`) sees every ``clip_grad_norm_`` and
``clip_grad_value_`` call while watching, and the user's line of one that saw no gradient.

Correct and silent: a materialised list, ``model.parameters()`` called anew at each clip,
a clip that clips every step (PPO's max-norm 0.5 is an effect, not its absence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class ClipWithoutEffectConfig(CheckConfig):
    """``clip_without_effect``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class ClipWithoutEffect(Check):
    """Per window: each clipping call that saw no gradient, by the line that made it."""

    id = "clip_without_effect"
    maturity = "stable"
    Config = ClipWithoutEffectConfig
    needs = frozenset({"clip_calls"})
    doc = CheckDoc(
        summary="A gradient clipping call saw no parameters or no gradients (an exhausted "
        "generator, a consumed `filter`), so nothing was clipped.",
        why="The run is unclipped while its config says it is: a loss spike that clipping "
        "was there to absorb goes straight into the weights.",
        causes=(
            "`params = filter(lambda p: p.requires_grad, model.parameters())` passed to the "
            "optimizer and then to `clip_grad_norm_` (the filter is empty the second time).",
            "A generator (`model.parameters()`) stored once and clipped on every step.",
            "Clipping before `backward()` or after `zero_grad()`: no `.grad` to clip.",
        ),
        fix="Materialise the parameters once: `params = [p for p in model.parameters() if "
        "p.requires_grad]`, and clip after `backward()` (after `scaler.unscale_` under AMP).",
        detail="a `clip_grad_norm_` or `clip_grad_value_` call saw no gradient, so it clipped "
        "nothing: an exhausted generator or a consumed `filter` (the optimizer's constructor read "
        "it first), or a clip before `backward()`. Every call is seen while watching, however it "
        "was imported (torch's `_get_total_norm` is wrapped, and "
        "`torch.nn.utils.clip_grad_value_`; restored on exit); named by the calling line "
        "(`details.called_at`). A list, a fresh `model.parameters()` each call, and a clip that "
        "clips every step (PPO's 0.5) are fine",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        clips = view.window.records.get("clips")
        if clips is None:
            return
        # What the clip was meant for: the parameters this step's optimizer updates (without
        # an optimizer, each backward is a step: the model's trainable parameters).
        meant = view.index.names(view.ids)
        of = "the model's trainable" if view.optimizer is None else f"{view.optimizer_name}'s"
        for function, line in clips.empty:
            at = f" at {line}" if line else ""
            details = {"function": function, "params_are": f"{of} parameters"}
            if line:
                details["called_at"] = line
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"`{function}`{at} saw no gradient: its parameters were an exhausted "
                "iterator (a generator or `filter` already read) or had no `.grad` yet, so "
                "nothing was clipped.",
                hint="Pass a list built once (`params = [p for p in model.parameters() if "
                "p.requires_grad]`) and clip after `backward()`.",
                params=meant,
                key=line or function,
                details=details,
            )
