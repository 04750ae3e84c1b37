"""``loss_term_dominates``: one term of a summed loss gives nearly all the gradient on what the
terms share.

From the ``loss_terms`` evidence of the loss-graph source: on scan steps, the norm of the
gradient each term of ``loss = a + b + ...`` sends into the values they share (the model's
trunk, measured where each term's own ops meet it). Over at least ``min_steps`` scan steps,
a term whose mean share is at least ``max_share`` fires, also with the user's own constant
weights taken out (``0.01 * aux`` drowned by its weight is scaled on purpose; ``-0.5 * kl``'s
constant is not what drowns it), unless a term's weight is learned (Kendall-style
uncertainty weighting balances the terms itself), or a term gave (next to) no gradient when
first seen (a consistency term to an EMA teacher copied from the student, a KL to a
reference policy: at its optimum at the start, small by design).

Two measurements tell a mis-scaled term from a design whose auxiliary terms are small, both
taken where each term leaves the loss code (the module output it reads, ``TermInfo.exit``):

- the model's path: where the terms' gradients are comparable as they leave the loss code,
  and one dominates only on the trunk, the model's own layers made the difference (BERT's
  NSP head behind its pooler, both initialised at std 0.02, next to the MLM head): not the
  loss's scale, which is what this check is about;
- declared auxiliaries: where every drowned term carries the user's constant weight
  (``router_aux_loss_coef * aux``, a consistency weight) and the dominating term's gradient
  per row (sample or token) where it leaves the loss code is that of a mean-reduced loss on
  values of unit scale (at most ``unit_row_grad``: a cross entropy's is at most sqrt(2)), the
  small terms are small on their own: a load-balancing loss at balance, a consistency term
  near a teacher copied from the student. A term in pixels, millimetres or summed over the
  batch has a row gradient of tens to thousands and still fires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pydantic import Field, StrictFloat, StrictInt

from gradwatch._severity import Severity
from gradwatch.capture.loss.term_shares import TermInfo
from gradwatch.checks._loss_graph import ScanConfig, graph_record
from gradwatch.checks._params import term_params
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class LossTermDominatesConfig(ScanConfig):
    """``loss_term_dominates``: the share that fires and the steps it is judged over."""

    severity: Severity = severity_field("warning")
    max_share: StrictFloat = Field(
        default=0.98,
        gt=0.5,
        le=1.0,
        description="A term whose mean share of the gradient on the shared values is at "
        "least this fires.",
    )
    min_steps: StrictInt = Field(
        default=3, ge=1, le=1000, description="Scan steps with a summed loss it is judged over."
    )
    unit_row_grad: StrictFloat = Field(
        default=4.0,
        gt=0.0,
        description="A dominating term whose gradient per row (sample, token) where it "
        "leaves the loss code is at most this is a loss on unit-scale values: next to it, "
        "terms with the user's constant weights are small on purpose (auxiliary terms).",
    )


class LossTermDominates(Check):
    """One term of a summed loss gives nearly all of the gradient on the parameters the terms
    share: the others barely train them (an unscaled regression term in pixels next to a
    classification term, a reconstruction summed over pixels next to a KL averaged)."""

    id = "loss_term_dominates"
    maturity = "stable"
    Config = LossTermDominatesConfig
    config: LossTermDominatesConfig
    needs = frozenset({"loss_terms"})
    doc = CheckDoc(
        summary="One term of a summed loss gives nearly all of the gradient on the parameters "
        "shared with the other terms, over the scan steps.",
        why="The other terms are there to shape the shared trunk, yet they move it by a few "
        "percent at most: the model trains as if they were not in the loss, and their own "
        "curves look flat.",
        causes=(
            "A detector's box regression in pixels (`l1_loss` on raw coordinates) next to its "
            "classification loss.",
            "A VAE's reconstruction summed over pixels (`reduction='sum'`) next to a KL "
            "averaged over the batch.",
            "Multitask heads whose targets have different scales (depth in millimetres, "
            "segmentation in logits).",
        ),
        fix="Normalise the terms' scales (targets in comparable units, the same reduction), "
        "weight them explicitly, or learn the weights (uncertainty weighting).",
        silence=(
            "A term scaled on purpose (`0.01 * aux_loss`, `beta * kl`) and losses with learned "
            "weights (Kendall et al.'s uncertainty weighting) are not judged.",
            "Designed auxiliary terms are not findings: a MoE router's load-balancing loss "
            "(`router_aux_loss_coef * aux`, Mixtral, Qwen2-MoE, Switch), a mean-teacher "
            "consistency term or a KL to a reference, each weighted and near its optimum next "
            "to a unit-scale main loss; and heads that the model's own layers make small "
            "(BERT's NSP next to its MLM: comparable where they leave the loss code).",
        ),
        detail="one term of a summed loss (the root's `+` tree, below a GradScaler's `* scale` or "
        "accumulation's `/ k`) gives at least `max_share` (98 %) of the gradient on the values "
        "the terms share, over at least `min_steps` (3) scan steps: a detector's box regression "
        "in pixels next to its classification, a VAE's reconstruction summed over pixels next to "
        "a batch-mean KL, depth in millimetres next to segmentation. Per-term attribution on the "
        "first `scan_steps` (8) steps: a hook on each node where a term's own ops meet the shared "
        "trunk adds the squared norm of the gradient it sends there to its term's device "
        "accumulator (read with the step's one transfer). Judged with the user's constant weights "
        "taken out too, so a term drowned only by its own weight (`0.001 * aux`) is scaled on "
        "purpose; losses with learned weights (Kendall's uncertainty weighting) and losses with a "
        "term that gives next to no gradient when first seen (a consistency term to an EMA "
        "teacher copied from the student, a KL to a reference policy: at its optimum at the "
        "start) are not judged. `details.terms`, `details.share`, `details.dominant`",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._sums: dict[tuple[str, ...], list[float]] = {}
        self._raw: dict[tuple[str, ...], list[float]] = {}
        self._at_start: dict[tuple[str, ...], bool] = {}
        self._steps: dict[tuple[str, ...], int] = {}
        self._exits: dict[tuple[str, ...], list[float]] = {}
        self._rowgrad: dict[tuple[str, ...], list[float]] = {}
        self._unmeasured: set[tuple[str, ...]] = set()

    def evidence(self) -> dict[str, int]:
        return {"loss_terms": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = graph_record(view)
        if rec is None or rec.terms is None:
            return
        terms, norms = rec.terms
        total = sum(norms)
        if total <= 0 or any(t.learned for t in terms):
            return
        # without the user's own weights (0.01 * aux): a term drowned by its weight is chosen
        raw = [v / abs(t.weight) if t.weight else v for v, t in zip(norms, terms)]
        key = tuple(t.label for t in terms)
        if key not in self._at_start:
            # a term at its optimum when it is first seen (a consistency term to an EMA
            # teacher copied from the student, RLHF's KL to the reference policy) is small
            # by design while the model is near its start: that loss is not judged
            self._at_start[key] = any(v <= 1e-6 * total for v in norms)
        if self._at_start.get(key):
            return
        sums = self._sums.setdefault(key, [0.0] * len(terms))
        unweighted = self._raw.setdefault(key, [0.0] * len(terms))
        for k, v in enumerate(norms):
            sums[k] += v / total
            unweighted[k] += raw[k] / (sum(raw) or 1.0)
        self._at_exit(key, terms)
        self._steps[key] = n = self._steps.get(key, 0) + 1
        if n < self.config.min_steps:
            return
        shares = [s / n for s in sums]
        top = max(range(len(shares)), key=shares.__getitem__)
        if min(shares[top], unweighted[top] / n) < self.config.max_share:
            return
        at_exit = self._designed(key, terms, top, n)
        if at_exit is None:
            return
        names = [f"{t.label}" + (f" ({t.module})" if t.module else "") for t in terms]
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"The loss term {names[top]} gives {shares[top]:.1%} of the gradient on the "
            f"values its terms share, over {n} scan steps: "
            f"{', '.join(names[k] for k in range(len(terms)) if k != top)} barely train them.",
            hint="Bring the terms to comparable scales (units of the targets, the same "
            "reduction), weight them explicitly, or learn the weights.",
            params=term_params(view.index, rec.graphs, len(terms), top),
            module=terms[top].module,
            details={
                "terms": names,
                "share": [round(s, 4) for s in shares],
                "dominant": names[top],
                "steps": n,
                **at_exit,
            },
            key="|".join(key),
        )

    def _at_exit(self, key: tuple[str, ...], terms: list[TermInfo]) -> None:
        """Add the step's shares where the terms leave the loss code, and each term's
        gradient per row there without its weight."""
        if any(t.rows <= 0 for t in terms):
            self._unmeasured.add(key)  # a term computed inside the model: its exit unseen
            return
        total = sum(t.exit for t in terms)
        exits = self._exits.setdefault(key, [0.0] * len(terms))
        rows = self._rowgrad.setdefault(key, [0.0] * len(terms))
        for k, t in enumerate(terms):
            exits[k] += t.exit / total if total > 0 else 0.0
            rows[k] += t.exit / abs(t.weight or 1.0) * t.rows**0.5

    def _designed(
        self, key: tuple[str, ...], terms: list[TermInfo], top: int, n: int
    ) -> Optional[dict[str, Optional[float]]]:
        """``None`` when a design explains the dominance (the model's path, or declared
        auxiliaries next to a unit-scale loss); else the top term's exit share and row
        gradient, for the finding's details (``None`` where its exit was not measured)."""
        if key in self._unmeasured or key not in self._exits:
            return {"exit_share": None, "row_grad": None}  # judged on the trunk alone
        exit_share = self._exits[key][top] / n
        row_grad = self._rowgrad[key][top] / n
        if exit_share < self.config.max_share:
            return None  # comparable where they leave the loss: the model's path
        weighted = all(t.weight is not None for k, t in enumerate(terms) if k != top)
        if weighted and row_grad <= self.config.unit_row_grad:
            return None  # auxiliaries weighted on purpose beside a unit-scale loss
        return {"exit_share": round(exit_share, 4), "row_grad": round(row_grad, 3)}
