"""``symmetric_units``: output units of a weight that start equal and stay equal.

Units (a Linear's rows, a convolution's output channels) that are equal get equal
gradients, and stay equal under any optimizer: the layer has the capacity of one unit per
group. The evidence (``weight_rows``, :mod:`gradwatch.sources.weight_rows`) compares each
weight's units by one projection per unit after the first step and again after step ``L``
(``later_step``), for weights that moved in between.

Correct and silent: a zero head or a zero-init residual branch (Fixup, ``zero_init_residual``)
whose first update breaks the symmetry, LayerNorm ones and zero biases (vectors, not units),
a weight that did not move (a skipped or frozen step: no evidence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, WatchSettings, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from typing import Any

    from gradwatch.checks.base import FindingLog


class SymmetricUnitsConfig(CheckConfig):
    """``symmetric_units``: when the second look is taken."""

    severity: Severity = severity_field("warning")
    later_step: StrictInt = Field(
        default=3,
        ge=1,
        description="Step after which units equal after the first step must have become distinct.",
    )


class SymmetricUnits(Check):
    """Once, after ``later_step``: units equal at both looks of a weight that moved."""

    id = "symmetric_units"
    maturity = "stable"
    Config = SymmetricUnitsConfig
    needs = frozenset({"weight_rows"})
    doc = CheckDoc(
        summary="Two or more output units of a weight matrix or conv kernel are exactly equal "
        "after the first step and still equal later, so the layer has the capacity of one "
        "unit per group.",
        why="Equal units receive equal gradients: no optimizer can tell them apart, and the "
        "layer behaves as if it had a handful of units. The loss still falls, slowly.",
        causes=(
            "Constant init: `nn.init.constant_(layer.weight, 0.5)`.",
            "Zero init of a hidden layer feeding tanh or sigmoid.",
            "One row copied into all: `w.data[:] = w.data[0]`.",
        ),
        fix="Initialise the weight randomly (the layer's default init, "
        "`nn.init.xavier_uniform_`, `kaiming_uniform_`); zero init only a layer whose "
        "input is already asymmetric (a head, a residual branch's last layer).",
        detail="two or more output units of a weight (a Linear's rows, a convolution's output "
        "channels, a Hugging Face `Conv1D`'s columns) are exactly equal after the first step and "
        "still equal after `later_step` (3), in a weight that moved in between: constant init, "
        "zero init of every layer with tanh/sigmoid, constant conv kernels. Compared by one "
        "projection per unit on device (one scalar per weight, read with the step's transfer; no "
        "copy of the weights, nothing after the second look). A zero head, a zero-init residual "
        "branch (Fixup), LoRA's zero `B`, LayerNorm ones (vectors), a weight that did not move "
        "(lr 0, a skipped step) are fine. `details.units`, `details.distinct`",
    )

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._done = False

    def evidence(self) -> dict[str, Any]:
        return {"weight_rows": self.config.later_step}  # type: ignore[attr-defined]

    def on_step(self, view: StepView, log: FindingLog) -> None:
        looks = view.window.records.get("weight_rows")
        if looks is None or not looks.done or self._done:
            return
        self._done = True
        for name, dups in looks.later.items():
            if not dups or not looks.first.get(name) or not looks.moved.get(name):
                continue
            units = looks.units[name]
            distinct = units - dups
            layer = name.rsplit(".", 1)[0]
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"'{name}' has {units} output units but only {distinct} distinct "
                f"one(s) after {looks.later_step + 1} steps: equal units get equal gradients "
                "and stay equal, so the layer has the capacity of "
                f"{distinct} unit(s).",
                hint="Initialise it randomly (the layer's default init, "
                "`nn.init.xavier_uniform_`); a constant or zero init is never broken by "
                "training.",
                params=[name],
                module=layer,
                key=name,
                details={"units": units, "distinct": distinct, "steps": looks.later_step + 1},
            )
