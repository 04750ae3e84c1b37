"""``stale_param``: finite non-zero gradients, yet none of a layer's values changed in the step."""

from __future__ import annotations

from math import inf
from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks._never_stepped import emit_never_stepped
from gradwatch.checks.views import RunView, StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class StaleParamConfig(CheckConfig):
    """``stale_param``: finite non-zero gradients, yet the layer's values did not change."""

    severity: Severity = severity_field("warning")
    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )


class StaleParam(Check):
    """Per layer, on observed optimizer steps (needs the values before and after the step)."""

    id = "stale_param"
    Config = StaleParamConfig
    doc = CheckDoc(
        summary="A layer had finite non-zero gradients, yet none of its values changed across "
        "the step, for patience observed steps.",
        why="Gradients are computed and thrown away: the layer silently does not train.",
        causes=(
            "Learning rate 0 in its param group (a scheduler at 0, a typo).",
            "The optimizer holds copies of the parameters, not the model's own tensors.",
            "A step skipped by custom code.",
            "Its optimizer never stepped while another watched optimizer did (one of a "
            "GAN's two `step()` calls forgotten): `cause: never_stepped`, an error.",
        ),
        fix="Check its param group's learning rate and that the optimizer holds the model's "
        "parameters (build it after the model is moved and complete).",
    )
    config: StaleParamConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._streaks = Streaks()

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None:
            return
        for layer, s in view.layers.items():
            if s.delta_norm is None:
                continue
            stale = s.delta_norm == 0.0 and 0 < s.norm < inf  # finite, non-zero gradients
            if self._streaks.hit(layer, stale) < self.config.patience:
                continue
            ids = [view.ids[k] for k in s.positions]
            details: dict[str, Any] = {"optimizer": view.optimizer, "grad_norm": s.norm}
            said, hint = "", _HINT
            if all(view.group_lr(i) == 0.0 for i in ids):
                said, hint = " Its param group's learning rate is 0.", _HINT_LR_ZERO
                details.update(cause="lr_zero", lr=0.0)
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': had gradients but its values did not change across "
                f"optimizer[{view.optimizer}].step() for {self.config.patience}+ observed "
                f"steps.{said}",
                hint=hint,
                params=view.index.names(ids),
                module=layer,
                details=details,
            )

    def on_run(self, view: RunView, log: FindingLog) -> None:
        emit_never_stepped(self.id, view, log)  # an optimizer forgotten (error)


_HINT = (
    "Check its param group's learning rate (0?), that the optimizer holds these exact tensors "
    "(re-created after .to()?), and any skipped or masked update."
)
_HINT_LR_ZERO = (
    "A learning rate of 0 trains nothing: check the group's 'lr' and the scheduler (a warm-up "
    "held at 0, a decay to 0). To keep the layer fixed on purpose, set requires_grad=False on "
    "its parameters so that no gradient is computed for it."
)
