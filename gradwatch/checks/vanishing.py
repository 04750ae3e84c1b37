"""``vanishing_grad``: a layer's mean |grad| stays below ``min_mean_abs`` (and is not zero)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, StepView
from gradwatch.checks.docs import CheckDoc
from gradwatch.config import VanishingGradConfig

if TYPE_CHECKING:
    from gradwatch.core.findings import FindingLog


class VanishingGrad(Check):
    """Per layer, on observed steps, over all of the layer's parameters."""

    id = "vanishing_grad"
    doc = CheckDoc(
        summary="A layer's mean absolute gradient stays below min_mean_abs for patience "
        "observed steps, without being exactly zero.",
        why="The layer effectively stops learning; in deep stacks it is usually the early "
        "layers, so the network trains as if it were shallow.",
        causes=(
            "Saturating activations (sigmoid/tanh chains) or a very deep stack without "
            "residual connections or normalisation.",
            "A tiny initialisation or a loss scaled down too far.",
        ),
        fix="Use residual connections, normalisation layers, ReLU-family activations or a "
        "better initialisation.",
        severity="warning",
        silence=("Lower the threshold: checks: {vanishing_grad: {min_mean_abs: 1e-9}}.",),
    )
    config: VanishingGradConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._streaks = Streaks()

    def on_step(self, view: StepView, log: FindingLog) -> None:
        limit = self.config.min_mean_abs
        for layer, s in view.layers.items():
            tiny = s.finite and 0.0 < s.mean_abs < limit
            if self._streaks.hit(layer, tiny) < self.config.patience:
                continue
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': mean |grad| {s.mean_abs:.3g} below {limit:g} for "
                f"{self.config.patience}+ observed steps.",
                hint="Gradients die before reaching this layer: use residual connections, "
                "normalisation, ReLU/GELU instead of saturating sigmoid/tanh, or a better "
                "initialisation.",
                params=view.index.names([view.ids[k] for k in s.positions]),
                module=layer,
                details={"mean_abs": s.mean_abs, "min_mean_abs": limit},
            )
