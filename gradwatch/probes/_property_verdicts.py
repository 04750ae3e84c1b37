"""The property probes' measurements as their report records and findings (SPEC 8.2)."""

from __future__ import annotations

from typing import Any, Optional

from gradwatch._severity import RANK
from gradwatch.checks.batch_order_dependent import BatchOrderDependent
from gradwatch.checks.dependence_outside_receptive_field import DependenceOutsideReceptiveField
from gradwatch.checks.forward_not_reproducible import ForwardNotReproducible
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.sample_weight_split import SampleWeightDependsOnSplit
from gradwatch.checks.update_ascends_loss import UpdateAscendsLoss
from gradwatch.probes.ascent import AscentResult
from gradwatch.probes.order import OrderResult
from gradwatch.probes.receptive import FieldResult
from gradwatch.probes.reproducible import ReproResult
from gradwatch.probes.split import SplitResult
from gradwatch.results import Finding, ProbeResult

__all__ = [
    "ascent_verdict",
    "field_verdict",
    "order_verdict",
    "repro_verdict",
    "split_verdict",
]


def _finding(check: str, severity: str, message: str, hint: str, **kw: Any) -> Finding:
    return Finding(check=check, severity=severity, message=message, hint=hint, **kw)


def order_verdict(res: OrderResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.memory_bytes = res.memory_bytes
    details: dict[str, Any] = {
        "batch": res.batch,
        "permutation": res.permutation[:64],
        "mode": res.mode,
        "output": res.output,
        "samples": res.samples[:32],
        "change": res.change,
        "loss": list(res.loss) if res.loss else None,
        "module": res.module,
        "last_same": res.last_same,
    }
    record.details.update(details)
    if res.mode == "eval":
        record.note = "judged in eval mode: the forward draws random numbers not aligned "
        record.note += "with the samples"
    if not res.moved:
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    where = (
        f"; the first module whose per-sample output moved is {res.module}"
        + (f" (after {res.last_same}, which did not)" if res.last_same else "")
        if res.module
        else ""
    )
    if res.output is not None:
        what = (
            f"{res.output} of {len(res.samples)} of {res.batch} sample(s) (e.g. sample "
            f"{res.samples[0]}) changed by {res.change:.3g} of its scale when the batch was "
            "permuted, beyond the permutation itself"
        )
        structured = ""
    else:
        assert res.loss is not None
        what = (
            f"the outputs only permuted, but loss_fn's value went from {res.loss[0]:.6g} "
            f"to {res.loss[1]:.6g}: the loss weighs samples by their place"
        )
        # A batch laid out on purpose (a few-shot episode's support then queries, pairs or
        # triplets by position) gives this too: a warning at most, and how to say so.
        severity = min(severity, "warning", key=RANK.__getitem__)
        structured = (
            " A batch laid out on purpose (a few-shot episode's support and queries, pairs "
            "or triplets by position) weighs samples by place: set "
            "checks.batch_order_dependent.compare_loss: false."
        )
    return _finding(
        BatchOrderDependent.id,
        severity,
        f"permuting the batch's {res.batch} samples (same weights, same RNG state, on a "
        f"copy): {what}{where}.",
        "A result must not depend on a sample's position in the batch: look for a tensor "
        "indexed by the batch position, outputs sorted (pack_padded_sequence) and never "
        "unsorted, a recurrence or view over the batch axis, a loss over the first samples."
        + structured,
        module=res.module if res.module and res.module != "(the model)" else None,
        details=details,
    )


def repro_verdict(res: ReproResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.memory_bytes = res.memory_bytes
    details: dict[str, Any] = {
        "state": res.state[:32],
        "read": res.read[:32],
        "reset": res.reset[:32],
        "output": res.output,
        "change": res.change,
        "samples": res.samples[:32],
    }
    record.details.update(details)
    if res.declared:
        record.verdict = NotObserved.id
        record.details["declared"] = res.declared
        record.details["reason"] = "declared_stateful"
        record.note = f"state carried on purpose, declared by {res.declared}: not judged"
        return _finding(
            NotObserved.id,
            "info",
            f"the {ForwardNotReproducible.id} probe did not judge this model: it carries "
            f"state across forwards on purpose ({res.declared}; state: "
            f"{', '.join(res.state[:6]) or 'none changed'}).",
            "Not a pass: the property was not judged for a model that keeps state.",
            details={"reason": "probe_declared_stateful", "probe": ForwardNotReproducible.id},
        )
    if not res.differs:
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    blamed = res.read or res.state
    said = (
        f"; the state it reads: {', '.join(res.read[:6])}"
        if res.read
        else (
            f"; state the first forward changed: {', '.join(res.state[:6])}"
            if res.state
            else "; no module attribute or buffer changed: the forward reads state outside "
            "the model (a global, a closure, an unseeded generator)"
        )
    )
    owner = blamed[0].rpartition(".")[0] if blamed else None
    return _finding(
        ForwardNotReproducible.id,
        severity,
        f"the same batch through the same weights with the same RNG state gave other "
        f"outputs on a second forward of a copy ({res.output} changed by {res.change:.3g} "
        f"of its scale, {len(res.samples)} sample(s)){said}.",
        "Reset the state at the start of each batch (or pass it as an argument); if it is "
        "carried on purpose (truncated BPTT, a cache), declare it: "
        "checks.forward_not_reproducible.stateful: true or allow: [names].",
        module=owner or None,
        details=details,
    )


def field_verdict(res: FieldResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.memory_bytes = res.memory_bytes
    reshape = res.reshape
    shown = (
        {"op": reshape.op, "before": list(reshape.before), "after": list(reshape.after)}
        | {"line": reshape.line}
        if reshape is not None
        else None
    )
    record.details.update(
        field_size=res.field_size, reach_all=res.reach_all, axes=res.axes, sample=res.sample
    )
    if res.not_judged:
        record.details["not_judged"] = res.not_judged
        record.note = "not judged: " + "; ".join(f"{k} ({v})" for k, v in res.not_judged.items())
    hit = res.outreach
    if hit is None:
        record.verdict = "passed" if res.axes else NotObserved.id
        if not res.axes:
            record.details["reason"] = res.reason
        return None
    record.verdict = "finding"
    details: dict[str, Any] = {
        "axis": hit.axis,
        "position": hit.position,
        "window": list(hit.window),
        "reached_positions": hit.reached[:32],
        "share": hit.share,
        "input": hit.input,
        "field_size": res.field_size,
        "reshape": shown,
    }
    record.details.update(details)
    via = (
        f"; the reshape that regrouped the axes: {reshape.op} {reshape.before} -> "
        f"{reshape.after} at {reshape.line}"
        if reshape is not None
        else "; no reshape the probe read regrouped the axes (an op it cannot read moved "
        "data between positions)"
    )
    return _finding(
        DependenceOutsideReceptiveField.id,
        severity if reshape is not None else "warning",
        f"output position {hit.position} (axis {hit.axis}) of sample {res.sample} has a "
        f"gradient on input positions {hit.reached[:8]} of {hit.input}, outside the "
        f"positions {hit.window[0]}..{hit.window[1]} its layers can reach (a receptive "
        f"field of {res.field_size:g}; {hit.share:.3g} x the gradient inside){via}.",
        "Move axes with permute/transpose, and use view/reshape only to merge or split "
        "neighbouring axes (x.transpose(1, 2), not x.view(B, C, L)).",
        details=details,
    )


def ascent_verdict(res: AscentResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.memory_bytes = res.memory_bytes
    groups = [
        {
            "group": g.index,
            "params": g.params[:16],
            "lr": g.lr,
            "slope": g.slope,
            "cosine": g.cosine,
            "status": g.status,
        }
        for g in res.groups
    ]
    record.details.update(optimizer=res.optimizer, groups=groups, set_aside=res.neutralised)
    unjudged = [g for g in res.groups if g.status not in ("descends", "ascends")]
    if unjudged:
        record.note = "not judged: " + ", ".join(f"group {g.index} ({g.status})" for g in unjudged)
    bad = res.ascending
    if not bad:
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    first = bad[0]
    names = ", ".join(first.params[:4]) + (" ..." if len(first.params) > 4 else "")
    more = f" (and {len(bad) - 1} more group(s))" if len(bad) > 1 else ""
    aside = f", with {', '.join(res.neutralised)} set aside" if res.neutralised else ""
    return _finding(
        UpdateAscendsLoss.id,
        severity,
        f"one step of {res.optimizer} (a new instance with the user's hyperparameters{aside}, "
        f"on a copy) moves param group {first.index} ({names}) up the loss's gradient: "
        f"g·u = {first.slope:.3g} > 0 (cosine {first.cosine:.2f}){more}: the update raises "
        "the loss it is given.",
        "Look for a sign error in a custom optimizer's step (p.data.add_(lr * grad)), "
        "maximize=True left on, or a negative learning rate.",
        params=[p for g in bad for p in g.params],
        details={"optimizer": res.optimizer, "groups": groups, "set_aside": res.neutralised},
    )


def split_verdict(
    res: SplitResult, record: ProbeResult, severity: str, *, tolerance: float, accumulates: bool
) -> Optional[Finding]:
    """The halves' weights: a finding when one half's samples weigh more than the other's
    by more than ``tolerance``; the check's ``severity`` only when the loop ``accumulates``,
    else ``info`` (the weights are the loss's design until micro-batches are added)."""
    record.memory_bytes = res.memory_bytes
    details: dict[str, Any] = {
        "batch": res.batch,
        "half": res.half,
        "weights": [float(f"{res.a:.6g}"), float(f"{res.b:.6g}")],
        "ratio": float(f"{res.ratio:.6g}"),
        "residual": float(f"{res.residual:.3g}"),
        "mode": res.mode,
        "accumulates": accumulates,
    }
    record.details.update(details)
    if res.ratio - 1.0 <= tolerance:
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    heavy, light = ("first", "second") if abs(res.a) > abs(res.b) else ("second", "first")
    loop = (
        "with the loop's accumulation, the update depends on the split"
        if accumulates
        else "this matters only if the loop accumulates micro-batches (config "
        "accumulation_steps > 1 says it does)"
    )
    return _finding(
        SampleWeightDependsOnSplit.id,
        severity if accumulates else "info",
        f"split into two halves of {res.half} samples (on a copy, in eval mode), the whole "
        f"batch's gradient is {res.a:.4g} x the first half's + {res.b:.4g} x the second's: "
        f"loss_fn divides each half by what it holds (its non-padded tokens, a weighted "
        f"count), so the whole batch weighs its {heavy} half {res.ratio:.2f} x its {light}, "
        "while micro-batch losses each divided by the accumulation steps weigh them alike "
        f"(the {light} half's elements count {res.ratio:.2f} x more); {loop}.",
        "Use reduction='sum' and divide by the step's total count of non-ignored elements "
        "(all micro-batches, all ranks: transformers' num_items_in_batch), or rescale each "
        "micro-batch's mean by count_i / total.",
        details=details,
    )
