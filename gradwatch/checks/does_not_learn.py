"""``does_not_learn``: overfitting one small batch with the user's optimizer fails.

A probe (:mod:`gradwatch.probes.overfit`): a few dozen steps of the user's own optimizer
class and hyperparameters on one fixed small batch, on a copy of the model; the loss must
fall well below its start.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["DoesNotLearn", "DoesNotLearnConfig"]


class DoesNotLearnConfig(CheckConfig):
    """``does_not_learn``: the steps, the target and the budget."""

    severity: Severity = severity_field("error")
    steps: int = Field(
        default=200,
        ge=2,
        description="Optimizer steps on the one batch at most (it stops at the target; a "
        "loss still falling at the end is no verdict).",
    )
    ratio: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="The loss's floor must fall below this fraction of its start "
        "(measured from |start| for a loss that can be negative).",
    )
    max_samples: int = Field(
        default=8,
        ge=1,
        description="Samples of the batch it trains on, spread over it (first and last included).",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


class DoesNotLearn(Check):
    """A copy of the model, trained on one fixed batch, does not bring the loss down."""

    id = "does_not_learn"
    maturity = "stable"
    Config = DoesNotLearnConfig
    doc = CheckDoc(
        summary="A few dozen steps of the user's optimizer (its class and hyperparameters, "
        "on a copy) on one fixed small batch did not bring the loss well below its start: "
        "the model cannot even overfit one batch.",
        why="Any model with a working loss, gradient and optimizer memorises a handful of "
        "samples; one that cannot has a bug that a long run only hides.",
        causes=(
            "A softmax (or sigmoid) before a loss that applies its own "
            "(`cross_entropy(softmax(logits))`): the loss has a floor far above zero.",
            "Identical units: a layer initialised to a constant (or zero), so its units get "
            "the same gradient and stay equal (`details.layers_that_did_not_move`).",
            "An output squashed to a range the targets are outside of (a sigmoid or "
            "`clamp(0, 1)` before a regression on other values), or a learning rate of 0.",
        ),
        fix="Look at `details.floor` against `details.start`, and at the layers that did "
        "not move: remove the extra normalisation, break the symmetry of the "
        "initialisation, check the output's range and the learning rate.",
        silence=(
            "A loss with no floor at 0 (it starts below 0, or a copy takes it below 0 on one "
            "sample: an eps-bounded adversarial perturbation, a density fitted by "
            "likelihood) is judged by convergence, not halving: it fell, stopped, and every "
            "layer the optimizer holds moved (`details.judged_by: convergence`).",
            "A model too small to memorise the batch (it fits 2 samples) or an adapter on a "
            "mostly frozen base (layers the optimizer does not hold count as frozen) is "
            "`not_observed`, unless the loss never fell.",
        ),
        detail="a probe (on a copy): up to `steps` (200) steps of the user's optimizer class and "
        "param groups' hyperparameters (a scheduler's `initial_lr`, not a warm-up's 0; Adam at "
        "1e-3 without an optimizer) on `max_samples` (8) samples spread over the batch of the "
        "batch, each evaluation seeded alike, do not bring the loss to `ratio` (0.5) of its "
        "start: a softmax before `cross_entropy`, a constant or zero initialisation (identical "
        "units), a sigmoid output for targets outside (0, 1). A loss still falling at the end is "
        "tried again at 10 x the learning rate: reaching the target then passes; heading for a "
        "floor above it (`details.floor_estimate`) is the finding; still falling is "
        "`not_observed` (`probe_still_falling`), never a pass. A floor that every layer the loss "
        "reaches trained towards is tried once more on 2 samples: a copy that fits those is only "
        "too small to memorise more (a linear model on 8 random targets), `not_observed` "
        "(`probe_capacity`), not a finding. A floor with most of the parameters frozen (an "
        "adapter: LoRA on a base it cannot judge; a random tiny base bounds what any adapter "
        "fits) and every trained layer moving is `not_observed` (`probe_frozen_base`); a layer "
        "the user's optimizer does not hold counts as frozen (a classifier an adversarial "
        "perturbation is trained against). A loss with no floor at 0 (it starts below 0, or a "
        "copy trained on one sample takes it below 0: a universal adversarial perturbation "
        "bounded by `eps`, a density fitted by likelihood, whose floor is the data's entropy) is "
        "judged by convergence instead of halving: it fell by more than 0.1 % of its start, "
        "stopped falling and every held layer moved is a pass (`details.judged_by: convergence`, "
        "`details.no_zero_floor` the evidence). A loss that never fell is a finding whatever the "
        "excuse. `details.start`, `details.floor`, `details.target`, `details.curve`, "
        "`details.layers_that_did_not_move`",
    )
