"""``freeze_not_applied``: a freezing flag that PyTorch ignores, while the module still trains.

``module.requires_grad = False`` (no underscore, no call) sets a plain Python attribute on
the module: PyTorch never reads it, and the module's parameters keep requiring grad. The same
holds for flags from other frameworks (``trainable = False``, ``frozen = True``). The evidence
(``module_flags``, ``gradwatch/capture/forward/modes.py``) is read once per layout from the modules'
own attributes; the finding needs the parameters to have really changed across a step (the
update every observed step measures).

Correct and silent: ``module.requires_grad_(False)``, ``p.requires_grad = False`` on each
parameter, and a flag on a module whose parameters are really frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.eval_mode import ROOT
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class FreezeNotAppliedConfig(CheckConfig):
    """``freeze_not_applied``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class FreezeNotApplied(Check):
    """Per flagged module, on observed steps: its layers' values changed across the step."""

    id = "freeze_not_applied"
    maturity = "stable"
    Config = FreezeNotAppliedConfig
    needs = frozenset({"module_flags"})
    doc = CheckDoc(
        summary="A module carries a plain `requires_grad = False` (or `trainable = False`, "
        "`frozen = True`) attribute that PyTorch ignores, while its parameters still require "
        "grad and are updated.",
        why="The module meant to be frozen (a pretrained encoder, an embedding) trains: its "
        "pretrained weights are overwritten, the optimizer spends memory on it, and nothing "
        "fails.",
        causes=(
            "`model.encoder.requires_grad = False` instead of "
            "`model.encoder.requires_grad_(False)`.",
            "A Keras habit: `layer.trainable = False`.",
            "A custom `frozen = True` flag that no code reads.",
        ),
        fix="Freeze the parameters: `module.requires_grad_(False)` (or "
        "`for p in module.parameters(): p.requires_grad = False`), before building the "
        "optimizer (or build it from trainable parameters only).",
        detail="a module carries a plain `requires_grad = False` (or `trainable = False`, `frozen "
        "= True`) attribute, which PyTorch ignores, while its parameters still require grad and "
        "changed across a step. `details.attribute`, `details.layers`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        flags = view.window.freeze_flags
        if not flags or view.optimizer is None or not view.layers:
            return
        for module, attr in flags:
            moved = [
                layer
                for layer, s in view.layers.items()
                if (module == ROOT or layer == module or layer.startswith(module + "."))
                and s.delta_norm
            ]
            if not moved:
                continue
            ids = [view.ids[k] for layer in moved for k in view.layers[layer].positions]
            value = "True" if attr in ("frozen", "freeze", "is_frozen") else "False"
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"'{module}' has `{attr} = {value}`, an attribute PyTorch ignores: its "
                f"parameters still require grad and {len(moved)} of its layer(s) changed "
                f"across {view.optimizer_name}.step().",
                hint=f"Freeze it with `{module if module != ROOT else 'model'}"
                ".requires_grad_(False)` (a method call, with the underscore), before building "
                "the optimizer.",
                params=view.index.names(ids),
                module=module,
                key=module,
                details={"attribute": attr, "layers": moved},
            )
