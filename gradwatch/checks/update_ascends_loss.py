"""``update_ascends_loss``: a step of the user's optimizer raises the loss to first order.

A probe (:mod:`gradwatch.probes.ascent`): one step of a new instance of the user's optimizer
class with its hyperparameters, on a copy of the model; each param group's update must not
point up the loss's gradient (``g·u < 0``), weight decay and random noise set aside.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["UpdateAscendsLoss", "UpdateAscendsLossConfig"]


class UpdateAscendsLossConfig(CheckConfig):
    """``update_ascends_loss``: the budget."""

    severity: Severity = severity_field("error")
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class UpdateAscendsLoss(Check):
    """One step of the user's optimizer, on a copy, goes up the loss's gradient."""

    id = "update_ascends_loss"
    maturity = "stable"
    Config = UpdateAscendsLossConfig
    doc = CheckDoc(
        summary="One step of a new instance of the user's optimizer class, with its "
        "hyperparameters (never its state), on a copy of the model, moves a param group "
        "along the loss's gradient: the loss rises to first order (`g·u > 0`).",
        why="The first step of every descent method (SGD with or without momentum, Adam and "
        "its kin, RMSprop, Adagrad, Lion, LBFGS, preconditioned or orthogonalised methods, "
        "clipping, SAM's final update) has a negative slope along the loss's gradient. "
        "Weight decay, a multi-iteration step and random (Langevin) noise are set aside "
        "before judging, so no correct optimizer on the loss it is given ascends.",
        causes=(
            "A sign error in a custom optimizer's update (`p.data.add_(lr * grad)`, "
            "`p.add_(grad, alpha=lr)`).",
            "`maximize=True` left on (copied from a reward-maximising example).",
            "A negative learning rate (a schedule or a sweep that went below 0, `lr=-1e-3`).",
        ),
        fix="Look at the named group's `details.slope` and the optimizer class: negate the "
        "update in the custom step, drop `maximize=True`, keep the learning rate positive. "
        "If loss_fn returns an objective to maximise on purpose, give the probe its negative.",
        silence=(
            "A loss negated by mistake is not this check's (the step still descends the loss "
            "it is given); groups the loss does not reach (a GAN's other player), updates "
            "below float rounding and random updates are not judged, and the record says so.",
        ),
        detail="a probe (on a copy): one step of a new instance of the user's optimizer class "
        "with its param groups' hyperparameters (never its state; `not_observed` without an "
        "optimizer) moves a param group up the loss's gradient to first order, `g·u > 0` beyond 4 "
        "x its float rounding bound: a sign error in a custom optimizer (`p.data.add_(lr * "
        "grad)`), `maximize=True` left on, a negative learning rate. Weight decay is set to 0 and "
        "LBFGS's `max_iter` to 1 on the copy (`details.set_aside`); the step gets a closure "
        "(LBFGS, SAM). Groups the loss does not reach (a GAN's other player), updates below float "
        "rounding and updates that differ between two seeds (Langevin noise) are not judged "
        "(`details.groups[].status`). A loss negated by mistake is not this check's (the step "
        "descends the loss it is given). `details.optimizer`, `details.groups` (`slope`, "
        "`cosine`, `params`)",
    )
