"""``decay_on_excluded_params``: weight decay on parameters the grouping meant to exclude.

Read from the param groups once per layout (``model_as_built``,
:func:`gradwatch.model.hparams.decay_misses`): a kind of parameter (norm gains, biases,
embeddings) split between a no-decay group and a decayed one, a no-decay list whose norm
names match none of the model's (``"LayerNorm.weight"`` on a model that names them
``ln_1``: transformers#16908), or AdamW decaying every norm gain and bias of a transformer
at ``weight_decay >= min_decay`` (lit-llama#254).

Correct and silent: nanoGPT's grouping (matrices and embeddings decayed, 1-D parameters
not), minGPT's (embeddings excluded too), torchvision's SGD recipe (decay on everything,
or ``norm_weight_decay=0`` alone), AdamW at torch's default decay of 0.01.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks._as_built import AsBuiltCheck
from gradwatch.checks.base import CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_KIND = {"norm": "norm gain", "norm_bias": "norm shift", "bias": "bias", "embedding": "embedding"}


class DecayExcludedConfig(CheckConfig):
    """``decay_on_excluded_params``: when decaying everything counts."""

    severity: Severity = severity_field("warning")
    min_decay: float = Field(
        default=0.05,
        ge=0.0,
        description="With no no-decay group, AdamW decaying every norm "
        "gain and bias of a transformer is judged from this weight_decay up.",
    )


class DecayOnExcludedParams(AsBuiltCheck):
    """Once per layout read: decayed parameters of a kind the grouping excludes."""

    id = "decay_on_excluded_params"
    maturity = "stable"
    Config = DecayExcludedConfig
    needs = frozenset({"model_as_built"})
    doc = CheckDoc(
        summary="Weight decay reaches parameters the user's own grouping meant to exclude "
        "(norm gains, biases, embeddings in a decayed group while a no-decay group exists), "
        "or AdamW decays every norm gain and bias of a transformer.",
        why="Decay pulls norm gains towards 0 and biases to 0: the normalisation layers lose "
        "their scale, which costs accuracy and stability and looks like an lr problem.",
        causes=(
            "A no_decay list such as `['bias', 'LayerNorm.weight']` on a model that names its "
            "norms `ln_1`/`norm`: no norm gain matches.",
            "An exclusion by name that misses some layers of a kind (`'norm'` but not `'ln_f'`).",
            "`AdamW(model.parameters(), weight_decay=0.1)` on a transformer.",
        ),
        fix="Group by kind, not by name: 1-D parameters (and embeddings, if meant) in a group "
        "with `weight_decay=0.0`, e.g. `[p for p in model.parameters() if p.dim() < 2]`.",
        detail="weight decay reaches parameters the user's own grouping meant to exclude: one "
        "kind (norm gains, norm shifts, biases, embeddings) split between a no-decay group and a "
        "decayed one (`details.reason: partial`), a no-decay list whose norm names match none of "
        'the model\'s (`["bias", "LayerNorm.weight"]` on `ln_1`: `unmatched`), or, with no '
        "no-decay group, AdamW decaying every norm gain and bias of a transformer at "
        "`weight_decay` >= `min_decay` (0.05) (`all`). Read from the param groups once per "
        "layout. nanoGPT's and minGPT's groupings, torchvision's SGD recipe (also with "
        "`norm_weight_decay=0`), transformers' `get_parameter_names` rule and AdamW at its "
        "default 0.01 are fine. `details.kind`, `details.groups`, `details.no_decay_group`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        built = self.fresh(view)
        if built is None:
            return
        groups = {(g.optimizer, g.group): g for g in built.groups}
        for miss in built.decay:
            decays = [groups[k].decay for k in miss.groups if k in groups]
            wd = max(decays) if decays else 0.0
            if miss.reason == "all" and wd < self.config.min_decay:  # type: ignore[attr-defined]
                continue
            kind = _KIND[miss.kind]
            where = ", ".join(f"{view.index.optimizer_label(k)} group {g}" for k, g in miss.groups)
            n = len(miss.names)
            shown = ", ".join(miss.names[:3]) + (", ..." if n > 3 else "")
            if miss.reason == "all":
                message = (
                    f"{where} decays every norm gain and bias of this transformer "
                    f"({n} parameters: {shown}) at weight_decay={wd:g}."
                )
            elif miss.reason == "unmatched":
                message = (
                    f"{n} {kind}(s) ({shown}) are decayed by {where} although a no-decay "
                    "group exists: its names match none of this model's norm layers."
                )
            else:
                message = (
                    f"{n} {kind}(s) ({shown}) are decayed by {where} while the no-decay "
                    f"group holds other {kind}s: the exclusion missed these names."
                )
            ex = miss.excluded
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=message,
                hint="Exclude by kind, not by name: put 1-D parameters (`p.dim() < 2`) in a "
                "group with `weight_decay=0.0`.",
                params=list(miss.names),
                key=f"{miss.reason}:{miss.kind}:{miss.groups}",
                details={
                    "kind": miss.kind,
                    "reason": miss.reason,
                    "weight_decay": wd,
                    "groups": [list(k) for k in miss.groups],
                    "no_decay_group": list(ex) if ex is not None else None,
                },
            )
