"""``sample_weight_depends_on_split``: accumulated micro-batches weigh their samples unequally.

A property of every correct program that accumulates gradients (several backward passes
per optimizer step): each sample's (or token's) weight in the update does not depend on how
the samples were split into micro-batches. The evidence (``loss_inputs``,
:mod:`gradwatch.capture.loss.loss_domain`) is, per scan step, every torch loss call with its
reduction, the count its ``mean`` divides by (the targets not ``ignore_index``, class weights
summed; the elements; ``batchmean``'s rows) and its value, and each backward pass's root
value. A backward whose root came from one loss call weighs each of that call's elements
by ``(root / value) / count`` (``mean``) or ``root / value`` (``sum``): what the user
multiplied the loss by is read, not assumed.

The finding: micro-batches of one step whose counts differ (by more than ``tolerance``)
and whose per-element weights differ by more than ``tolerance`` too: a token-level loss
averaged per micro-batch over unequal numbers of non-padded tokens (the Hugging Face
gradient-accumulation bug of 2024: tokens of short micro-batches weigh more), a last
partial micro-batch averaged like the full ones.

Correct and silent: ``loss / accumulation_steps`` over equal micro-batches, a ``sum``
divided by the step's total count (the fix transformers adopted: ``num_items_in_batch``),
a mean rescaled by ``count_i / total``, a single backward per step. Not judged: a uniform
scale (``loss.backward()`` per micro-batch without ``/ k`` weighs every sample ``k`` times
alike: the learning rate's business, not a sample's), backwards whose root combines several
loss calls or a hand-written loss, ``reduction='none'`` reduced by hand.

The probe part (:mod:`gradwatch.probes.split`) judges any ``loss_fn``, hand-written too: the
whole batch's gradient against its two halves', on a copy.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.capture.loss.loss_domain import LossCall
from gradwatch.checks._loss_graph import ScanConfig
from gradwatch.checks.base import Check, FindingLog, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

__all__ = ["SampleWeightDependsOnSplit", "SampleWeightDependsOnSplitConfig"]

_DIVIDES = {"mean": True, "batchmean": True, "sum": False}


class SampleWeightDependsOnSplitConfig(ScanConfig):
    """``sample_weight_depends_on_split``: read on the first ``scan_steps`` steps."""

    severity: Severity = severity_field("warning")
    tolerance: float = Field(
        default=0.1,
        gt=0,
        description="Relative spread of the micro-batches' counts, and of their elements' "
        "weights, beyond which they differ.",
    )
    accumulation_steps: Optional[int] = Field(
        default=None,
        ge=1,
        description="Micro-batches per optimizer step, for the probe (it cannot see the "
        "loop): above 1 its finding carries `severity`; unset or 1, it is `info`.",
    )
    budget_s: float = Field(default=5.0, gt=0, description="Seconds the probe may take.")


def _weight(call: LossCall, root: float) -> Optional[float]:
    """Each element's weight in this backward's gradient, or ``None`` when not judged."""
    divides = _DIVIDES.get(str(call.settings.get("reduction", "mean")))
    if divides is None or not all(map(math.isfinite, (call.count, call.value, root))):
        return None
    if call.value == 0.0 or call.count <= 0:
        return None
    w = root / call.value
    return w / call.count if divides else w


def _spread(xs: list[float]) -> float:
    lo, hi = min(xs), max(xs)
    return hi / lo - 1.0 if lo > 0 else math.inf


class SampleWeightDependsOnSplit(Check):
    """Per scan step with several backward passes: the micro-batches' per-element weights."""

    id = "sample_weight_depends_on_split"
    maturity = "stable"
    Config = SampleWeightDependsOnSplitConfig
    config: SampleWeightDependsOnSplitConfig
    needs = frozenset({"loss_inputs"})
    doc = CheckDoc(
        summary="Several backward passes accumulated into one optimizer step weigh their "
        "samples (or tokens) unequally: each micro-batch's loss is a mean over a different "
        "count, so an element's weight depends on the micro-batch it fell in.",
        why="Accumulating k micro-batches must give the gradient of the whole batch: a mean "
        "of per-micro-batch means is not the mean over the samples when the counts differ. "
        "Tokens of short micro-batches (few non-padded tokens) and samples of a last partial "
        "micro-batch count more, and the result changes with the accumulation setting.",
        causes=(
            "A token-level language-model loss (`cross_entropy(..., ignore_index=-100)`, "
            "or a Hugging Face model's own `labels` loss) averaged per micro-batch and "
            "divided by the accumulation steps: the transformers gradient-accumulation bug "
            "fixed in 2024 with `num_items_in_batch`.",
            "A last partial micro-batch (the dataset's remainder) averaged like the full ones.",
            "Micro-batches of variable length (bucketing, packing) each with a `mean` loss.",
        ),
        fix="Compute the loss with `reduction='sum'` and divide by the step's total count of "
        "non-ignored elements (summed over its micro-batches, and over ranks under DDP), or "
        "rescale each micro-batch's mean by `count_i / total`.",
        silence=(
            "A uniform scale (every micro-batch's mean, not divided by the accumulation "
            "steps) weighs all samples alike: the learning rate's business, not reported.",
        ),
        detail="several backward passes accumulated into one optimizer step weigh their samples "
        "(or tokens) unequally: each micro-batch's torch loss is a `mean` over a different count "
        "(the targets not `ignore_index`, class weights summed; the elements; `batchmean`'s "
        "rows), and each element's weight in the update, `(root / loss value) / count` read from "
        "the backward's root (what the user multiplied the loss by is read, not assumed), differs "
        "with it by more than `tolerance` (0.1): a token-level LM loss averaged per micro-batch "
        "over unequal non-padded tokens and divided by the accumulation steps (the transformers "
        "gradient-accumulation bug of 2024, also through a Hugging Face model's own `labels` "
        "loss), a last partial micro-batch averaged like the full ones, variable-length buckets. "
        "Read on the first `scan_steps` (8) steps by the loss-call `TorchFunctionMode` of "
        "`loss_input_out_of_domain` (counts and values join the step's one transfer); "
        "`details.counts`, `details.element_weights`, `details.reduction`, `details.called_at`. "
        "`loss / k` over equal micro-batches, `reduction='sum'` divided by the step's total count "
        "(`num_items_in_batch`), a mean rescaled by `count / total`, one backward per step are "
        "fine; a uniform scale (no `/ k`) is the learning rate's and not reported; a backward "
        "whose root combines several torch losses, a hand-written loss or `reduction='none'` are "
        "not judged. The probe (`gradwatch.probe`, `Watcher.probe`, with the user's `loss_fn`: hand-"
        "written losses too) splits the batch into two equal halves on a copy in eval mode and "
        "solves the whole batch's gradient as `a gA + b gB`: `a / b` beyond `1 + tolerance` is a "
        "loss that divides each half by what it holds (`details.weights`, `details.ratio`); a "
        "`warning` when `accumulation_steps` > 1, else `info`. A loss that couples samples "
        "(`details.residual` > 1e-3: contrastive, graph, batch-hard) or halves whose gradients are "
        "parallel are not judged",
    )

    def evidence(self) -> dict[str, int]:
        return {"loss_inputs": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = view.window.records.get("loss_domain")
        roots = list(getattr(rec, "roots", []) or [])
        if rec is None or len(roots) < 2:
            return
        by_pass: dict[int, list[LossCall]] = {}
        for call in rec.calls:
            if call.backward < len(roots):
                by_pass.setdefault(call.backward, []).append(call)
        parts: dict[tuple[str, Optional[str]], list[tuple[LossCall, float]]] = {}
        for i, calls in sorted(by_pass.items()):
            if len(calls) != 1:
                continue  # a root of several losses: no one weight to read
            w = _weight(calls[0], roots[i])
            if w is not None:
                parts.setdefault((calls[0].loss, calls[0].site), []).append((calls[0], w))
        tol = self.config.tolerance
        for (loss, site), seen in parts.items():
            counts = [c.count for c, _ in seen]
            weights = [abs(w) for _, w in seen]
            if len(seen) >= 2 and _spread(counts) > tol and _spread(weights) > tol:
                self._emit(view, log, loss, site, seen)

    def _emit(
        self,
        view: StepView,
        log: FindingLog,
        loss: str,
        site: Optional[str],
        seen: list[tuple[LossCall, float]],
    ) -> None:
        counts = [c.count for c, _ in seen]
        weights = [w for _, w in seen]
        lo, hi = (
            min(range(len(seen)), key=lambda k: abs(weights[k])),
            max(range(len(seen)), key=lambda k: abs(weights[k])),
        )
        first = seen[0][0]
        at = f" at {site}" if site else ""
        details: dict[str, Any] = {
            "loss": loss,
            "called_at": site,
            "reduction": first.settings.get("reduction"),
            "counts": [round(c, 3) for c in counts],
            "element_weights": [float(f"{w:.6g}") for w in weights],
            "backward_passes": len(seen),
        }
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{len(seen)} backward passes accumulated into one step each ran {loss}{at} "
            f"with reduction={details['reduction']!r} over {min(counts):.0f} to {max(counts):.0f} "
            f"elements: an element of the micro-batch of {counts[hi]:.0f} weighs "
            f"{abs(weights[hi] / weights[lo]):.2f} x one of the micro-batch of "
            f"{counts[lo]:.0f} in the update; the weight depends on the split.",
            hint="Use reduction='sum' and divide by the step's total count of non-ignored "
            "elements (all micro-batches, all ranks), or rescale each micro-batch's mean by "
            "count_i / total.",
            params=first.params or None,
            module=first.producer,
            details=details,
            key=f"{loss}:{site}",
        )
