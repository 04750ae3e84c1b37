"""``dependence_outside_receptive_field``: an output position depends on input positions no
layer of the model can connect.

A probe (:mod:`gradwatch.probes.receptive`), loss-free: the receptive field the forward's ops
make, against the gradient of a few output positions on the input positions.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["DependenceOutsideReceptiveField", "DependenceOutsideReceptiveFieldConfig"]


class DependenceOutsideReceptiveFieldConfig(CheckConfig):
    """``dependence_outside_receptive_field``: the share of gradient, and the budget."""

    severity: Severity = severity_field("error")
    min_share: float = Field(
        default=1e-6,
        ge=0,
        description="Gradient norm on input positions outside the field, relative to the "
        "norm inside it, above which it is a dependence (the layers give exactly zero).",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class DependenceOutsideReceptiveField(Check):
    """An output position has a gradient on input positions its layers cannot reach."""

    id = "dependence_outside_receptive_field"
    maturity = "stable"
    Config = DependenceOutsideReceptiveFieldConfig
    doc = CheckDoc(
        summary="An output position of the model has a gradient on input positions outside "
        "the receptive field that its layers make (convolutions and pooling reach a bounded "
        "neighbourhood, pointwise layers only the position itself): an op moved data "
        "between positions that no layer connects.",
        why="A reshape that scrambles axes trains without an error: the model still fits "
        "something, but a position's output reads channels of far-away positions, so it "
        "learns the layout of the batch instead of the signal.",
        causes=(
            "`x.view(B, C, L)` (or `reshape`) of a `(B, L, C)` tensor before a `Conv1d`, "
            "instead of `x.transpose(1, 2)`.",
            "`x.view(B, H, W, C)` of a `(B, C, H, W)` feature map before a per-pixel head, "
            "instead of `x.permute(0, 2, 3, 1)`.",
            "`transpose` then `view` back in the wrong order, or a `view` that splits a "
            "merged `(B, L * C)` tensor with its factors swapped.",
        ),
        fix="Use `permute`/`transpose` to move axes and `view`/`reshape` only to merge or "
        "split neighbouring ones; the reshape named in `details.reshape` regrouped them.",
        silence=(
            "Models that reach every position (attention, recurrence, global pooling, group "
            "or instance norm, reductions over positions) or whose field covers the axis "
            "are not judged; the record says which op made it so.",
        ),
        detail="a probe (on a copy, loss-free; batch norms in eval, dropout off): the receptive "
        "field read from the forward's ops (convolutions and local pooling: `(k - 1) * dilation` "
        "times the stride so far; pointwise layers: none; attention, recurrence, global pooling, "
        "group/instance norm, reductions over positions, data-dependent indexing: every position, "
        "not judged) against the gradient of a few output positions spread along each position "
        "axis on the input positions: a gradient outside the field, beyond `min_share` (1e-6) of "
        "the one inside, is a dependence no layer made: `x.view(B, C, L)` of a `(B, L, C)` tensor "
        "before a `Conv1d`, `feat.view(B, H, W, C)` before a per-pixel head. `details.reshape` "
        "names the reshape that regrouped the axes and its line (without one, a `warning`); "
        "`details.window`, `details.reached_positions`. A field that covers the axis, or an "
        "output without a position axis, is said in the record (`not_judged`)",
    )
