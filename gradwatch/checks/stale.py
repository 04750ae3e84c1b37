"""``stale_param``: finite non-zero gradients, yet none of a layer's values changed in the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, StepView
from gradwatch.config import StaleParamConfig

if TYPE_CHECKING:
    from gradwatch.core.findings import FindingLog


class StaleParam(Check):
    """Per layer, on observed optimizer steps (needs the values before and after the step)."""

    id = "stale_param"
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
            stale = s.finite and s.norm > 0 and s.delta_norm == 0.0
            if self._streaks.hit(layer, stale) < self.config.patience:
                continue
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': had gradients but its values did not change across "
                f"optimizer[{view.optimizer}].step() for {self.config.patience}+ observed steps.",
                hint="Check its param group's learning rate (0?), that the optimizer holds these "
                "exact tensors (re-created after .to()?), and any skipped or masked update.",
                params=view.index.names([view.ids[k] for k in s.positions]),
                module=layer,
                details={"optimizer": view.optimizer, "grad_norm": s.norm},
            )
