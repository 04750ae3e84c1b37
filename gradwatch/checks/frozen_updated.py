"""``frozen_param_updated``: a ``requires_grad=False`` parameter changed across a step.

``requires_grad_(False)`` after the optimizer was built leaves the parameter in it; with
``zero_grad(set_to_none=False)`` (or a gradient left from before the freeze) the optimizer
still steps it, and weight decay and momentum keep moving the "frozen" weights. What each
optimizer changed is read from copy-free fingerprints of the frozen parameters it holds
(exact change detection, ``gradwatch/measure/fingerprint.py``) on observed steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class FrozenParamUpdatedConfig(CheckConfig):
    """``frozen_param_updated``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class FrozenParamUpdated(Check):
    """Per layer: frozen parameters of one optimizer whose values moved in its step."""

    id = "frozen_param_updated"
    maturity = "stable"
    Config = FrozenParamUpdatedConfig
    needs = frozenset({"model_as_built"})  # each param group's momentum and weight decay
    doc = CheckDoc(
        summary="A parameter with `requires_grad=False` changed across an optimizer step.",
        why="A layer meant to be frozen (a pretrained backbone, a teacher) drifts: results "
        "depend on what was supposed to be fixed.",
        causes=(
            "The frozen parameter is still in an optimizer whose weight decay moves it "
            "(`AdamW`, `SGD(weight_decay=...)`).",
            "Momentum or Adam state left from before freezing keeps moving it.",
        ),
        fix="Build the optimizer from trainable parameters only: "
        "`AdamW(p for p in model.parameters() if p.requires_grad)`, or rebuild it after "
        "freezing.",
        detail="a `requires_grad=False` parameter changed across its optimizer's step (frozen "
        "after the optimizer was built; weight decay/momentum still move it). Read from copy-free "
        "fingerprints on observed steps",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if not view.frozen_changed or view.optimizer is None:
            return
        by_layer: dict[str, list[int]] = {}
        for i in view.frozen_changed:
            by_layer.setdefault(view.index.params[i].layer, []).append(i)
        # The optimizer's param groups as built: which hold frozen parameters is not known
        # (a step reads only the trainable ones), so the causes are named when every group
        # of the optimizer has the same (one group, as usual).
        built = view.window.records.get("built")
        groups = [g for g in getattr(built, "groups", ()) if g.optimizer == view.optimizer]
        per_group = {tuple(_causes([g])) for g in groups}
        causes = list(next(iter(per_group))) if len(per_group) == 1 else []
        what = " and ".join(text for _, text in causes) or "weight decay or momentum"
        for layer, idxs in by_layer.items():
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"{len(idxs)} frozen parameter(s) of '{layer}' (requires_grad=False) "
                f"changed across {view.optimizer_name}.step(): {what} still "
                f"move{'s' if len(causes) == 1 else ''} them.",
                hint="Remove them from the optimizer (rebuild it after freezing, or keep only "
                "p.requires_grad parameters in its groups), or set their grads to None "
                "(zero_grad(set_to_none=True)) so the optimizer skips them.",
                params=view.index.names(idxs),
                module=layer,
                details={"optimizer": view.optimizer, "causes": [c for c, _ in causes]},
            )


def _causes(groups: list[Any]) -> list[tuple[str, str]]:
    """``(cause, how a message says it)`` of the param groups holding the moved parameters:
    ``momentum`` (SGD's, or an Adam-family optimizer's moving averages) and ``weight_decay``
    (with its value); empty when the groups are not known."""
    momentum, decay = [], []
    for g in groups:
        if g is None:
            continue
        m = g.hparams.get("momentum")
        if isinstance(m, (int, float)) and m > 0:
            momentum.append(f"{g.cls}'s momentum ({m:g})")
        elif g.adam_family:
            momentum.append(f"{g.cls}'s moving averages of past gradients")
        if g.decay > 0:
            decay.append(f"weight decay ({g.decay:g})")
    out = []
    if momentum:
        out.append(("momentum", momentum[0]))
    if decay:
        out.append(("weight_decay", decay[0]))
    return out
