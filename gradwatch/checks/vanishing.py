"""``vanishing_grad``: a layer's gradient is tiny, in absolute terms and for its own scale.

Rule (see :class:`VanishingGradConfig`): mean |grad| below
``min_mean_abs`` (not zero) *and* a relative scale below ``relative`` x the smallest one
among the layers whose gradients are not tiny, on that step. The relative scale is the layer's update
ratio ``|Δθ|/|θ|`` when the step's update was measured, else its gradient norm over its
parameter norm (no optimizer). Without a healthy layer to compare, the absolute rule decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import repeat
from operator import lt
from typing import TYPE_CHECKING, Optional

from pydantic import Field, StrictFloat, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import LayerSample, LayerTable, StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

MIN_LAYERS = 3  # update ratios of fewer layers: fall back to the gradient ratio


def relative_scales(layers: Mapping[str, LayerSample]) -> tuple[str, dict[str, float]]:
    """Per layer, its scale-free size on this step: ``("update", ...)`` or ``("grad", ...)``.

    The update ratio when at least ``MIN_LAYERS`` layers have one (an optimizer stepped and
    the update was measured), else the gradient-to-parameter norm ratio; a layer whose
    parameters are all zero has neither.
    """
    updates = {
        name: s.delta_norm / s.param_norm
        for name, s in layers.items()
        if s.delta_norm is not None and s.param_norm
    }
    if len(updates) >= MIN_LAYERS:
        return "update", updates
    return "grad", {name: s.norm / s.param_norm for name, s in layers.items() if s.param_norm}


class VanishingGradConfig(CheckConfig):
    """``vanishing_grad``: a layer's gradient is tiny in absolute terms *and* for its own scale.

    A layer vanishes on an observed step when its mean |grad| is below ``min_mean_abs`` (not
    zero) and its update ratio ``|Δθ|/|θ|`` (with an optimizer; without one, its gradient
    norm over its parameter norm) is below ``relative`` x the smallest such ratio among the
    model's layers whose gradients are not tiny (the slowest healthy layer).
    Adam-family optimizers rescale small gradients, so a layer with tiny gradients that
    still moves like the others (attention query/key projections at initialisation,
    LayerScale blocks) is healthy; under SGD, or with gradients so small that Adam's ``eps``
    swamps them (a deep saturated sigmoid chain), its update falls behind and it fires.
    Without such a layer to compare with, the absolute rule alone decides.
    """

    severity: Severity = severity_field("warning")
    min_mean_abs: StrictFloat = Field(
        default=1e-7,
        gt=0,
        description="A layer whose mean absolute gradient is at or above this never vanishes "
        "(1e-7, as SageMaker Debugger's rule).",
    )
    relative: StrictFloat = Field(
        default=0.01,
        gt=0,
        description="...and it vanishes only when its update ratio (without an optimizer: "
        "gradient norm / parameter norm) is below this fraction of the smallest such ratio "
        "among the model's layers whose mean |grad| is at least min_mean_abs, on that step.",
    )
    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )


class VanishingGrad(Check):
    """Per layer, on observed steps, over all of the layer's parameters."""

    id = "vanishing_grad"
    maturity = "stable"
    Config = VanishingGradConfig
    doc = CheckDoc(
        summary="A layer's mean absolute gradient stays below min_mean_abs (not zero) and its "
        "update ratio (without an optimizer: grad/param norm ratio) below relative x that of "
        "the slowest healthy layer, for patience observed steps.",
        why="The layer effectively stops learning; in deep stacks it is usually the early "
        "layers, so the network trains as if it were shallow.",
        causes=(
            "Saturating activations (sigmoid/tanh chains) or a very deep stack without "
            "residual connections or normalisation.",
            "A tiny initialisation or a loss scaled down too far.",
        ),
        fix="Use residual connections, normalisation layers, ReLU-family activations or a "
        "better initialisation.",
        silence=(
            "Lower the thresholds: checks: {vanishing_grad: {min_mean_abs: 1e-9, "
            "relative: 0.001}}.",
        ),
        detail="a layer's mean |grad| below `min_mean_abs` (1e-7), not zero, and its update ratio "
        "|Δθ|/|θ| (without an optimizer: grad norm / param norm) below `relative` (0.01) x that "
        "of the slowest layer whose gradients are not tiny, for `patience` (3) observed steps. "
        "Layers that Adam still moves like the others (attention q/k at init, LayerScale blocks) "
        "are healthy; a deep saturated sigmoid chain fires",
    )
    config: VanishingGradConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._streaks = Streaks()

    def on_step(self, view: StepView, log: FindingLog) -> None:
        limit = self.config.min_mean_abs
        if not self._streaks and not any(
            map(lt, LayerTable.of(view.layers).mean_abs, repeat(limit))
        ):
            return  # no layer below the limit and none on a streak: nothing changes
        tiny = {
            layer: s for layer, s in view.layers.items() if s.finite and 0.0 < s.mean_abs < limit
        }
        kind = ""
        scales: dict[str, float] = {}
        ref: Optional[float] = None
        if tiny:
            kind, scales = relative_scales(view.layers)
            # The reference: the slowest layer whose gradients are not tiny. Not a median over
            # every layer (in a deep saturated chain most layers vanish and would excuse one
            # another), nor over the healthy ones (LayerScale's gammas, whose ratio is
            # lr/1e-5, would pull it far above the linear layers').
            healthy = [
                v
                for k, v in scales.items()
                if view.layers[k].mean_abs >= limit and math.isfinite(v) and v > 0
            ]
            ref = min(healthy) if healthy else None
        for layer, s in view.layers.items():
            hit = layer in tiny
            scale = scales.get(layer)
            if hit and ref is not None and scale is not None:
                hit = scale < self.config.relative * ref
            if self._streaks.hit(layer, hit) < self.config.patience:
                continue
            details: dict[str, object] = {"mean_abs": s.mean_abs, "min_mean_abs": limit}
            versus = ""
            if ref is not None and scale is not None:
                name = "update ratio" if kind == "update" else "grad/param norm ratio"
                details.update({kind + "_ratio": scale, "reference_" + kind + "_ratio": ref})
                versus = f", {name} {scale:.3g} vs {ref:.3g} for the slowest healthy layer"
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': mean |grad| {s.mean_abs:.3g} below {limit:g}"
                f"{versus}, for {self.config.patience}+ observed steps.",
                hint="Gradients die before reaching this layer: use residual connections, "
                "normalisation, ReLU/GELU instead of saturating sigmoid/tanh, or a better "
                "initialisation.",
                params=view.index.names([view.ids[k] for k in s.positions]),
                module=layer,
                details=details,
            )
