"""``nonfinite_grad``: NaN/Inf in a gradient, with the parameter where it started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks.base import Check, StepView
from gradwatch.checks.docs import CheckDoc

if TYPE_CHECKING:
    from gradwatch.core.findings import FindingLog


class NonfiniteGrad(Check):
    """Names the first parameter, in backward order, whose gradient went non-finite."""

    id = "nonfinite_grad"
    doc = CheckDoc(
        summary="A gradient holds NaN or Inf; details.origin names the first parameter, in "
        "backward order, where it appeared.",
        why="One NaN step poisons the weights (and Adam's state) for good: the loss turns NaN "
        "and the run is lost, often long after the cause.",
        causes=(
            "sqrt/log/division at 0, also inside torch.where, whose untaken branch still "
            "back-propagates.",
            "fp16 overflow without a GradScaler.",
            "A learning rate so high that activations overflow.",
        ),
        fix="Look at the operation that consumes details.origin; guard the input (clamp, eps), "
        "use a GradScaler or bf16, or lower the learning rate. Steps a GradScaler skips are "
        "expected and reported as info.",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        bad = [k for k, b in enumerate(view.nonfinite) if b]
        if not bad:
            return
        # Backward visits parameters from the loss outwards; the earliest arrival is the origin,
        # the later ones inherited the NaN/Inf from it.
        arrived_bad = [k for k in bad if view.arrived[k]] or bad
        origin_k = min(arrived_bad, key=lambda k: view.order[k])
        origin = view.index.params[view.ids[origin_k]]
        names = view.index.names([view.ids[k] for k in bad])
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"non-finite gradient (NaN/Inf) in {len(names)} parameter(s); it starts at "
            f"'{origin.name}' (first in backward order).",
            hint="Look at the operation that consumes this parameter: sqrt/log/div at 0 (also "
            "inside torch.where, whose untaken branch still back-propagates), overflow in fp16 "
            "(use a GradScaler or bf16), or a too-high learning rate.",
            params=names,
            module=origin.layer,
            details={
                "origin": origin.name,
                "origin_layer": origin.layer,
                "nonfinite_params": len(names),
            },
        )

    def on_skipped(self, skipped: int, total: int, step: int, log: FindingLog) -> None:
        """A GradScaler skipped ``skipped`` steps for inf/NaN gradients: expected, ``info``."""
        log.emit(
            self.id,
            severity="info",
            step=step,
            message=f"GradScaler skipped {total} optimizer step(s) because gradients held inf/NaN "
            "(expected while the loss scale calibrates).",
            hint="Nothing to do unless skips keep happening after the first steps; then look for "
            "a NaN source (run without autocast to find its origin).",
            key="grad_scaler",
            details={"skipped_steps": total, "cause": "grad_scaler"},
        )
