"""Each probe's measurement as its report record and its findings (one per check at most)."""

from __future__ import annotations

import math
from typing import Any, Optional

from gradwatch.checks.does_not_learn import DoesNotLearn
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.sample_dependence import SampleDependence
from gradwatch.probes._sandbox import CannotJudge
from gradwatch.probes.gradient import GradientResult
from gradwatch.probes.overfit import OverfitResult
from gradwatch.probes.positions import Leak
from gradwatch.probes.samples import SampleResult
from gradwatch.results import Finding, ProbeResult

__all__ = ["gradient_verdict", "not_judged", "overfit_verdict", "sample_verdict"]


def _finding(check: str, severity: str, message: str, hint: str, **kw: Any) -> Finding:
    return Finding(check=check, severity=severity, message=message, hint=hint, **kw)


def not_judged(check_id: str, exc: CannotJudge, record: ProbeResult) -> Finding:
    """The probe could not judge: a ``not_observed`` (``info``: only this check is blind)."""
    record.verdict = NotObserved.id
    record.note = str(exc)
    record.details["reason"] = exc.reason
    return _finding(
        NotObserved.id,
        "info",
        f"the {check_id} probe could not judge this model: {exc}",
        "The probe's verdict is missing, not a pass; see the report's probes section.",
        details={"reason": f"probe_{exc.reason}", "probe": check_id},
    )


def _gradient_note(res: GradientResult, record: ProbeResult) -> None:
    """What the record says beside its rows: the layers explained, those not judged
    (inconclusive), and whether layers were sampled."""
    explained = [r.name for r in res.layers if r.status == "explained"]
    notes = [_explained_note(res, explained)] if explained else []
    unsure = [r.name for r in res.layers if r.status == "inconclusive"]
    if unsure:  # not judged, and said: no layer passes unseen
        notes.append(
            f"{len(unsure)} layer(s) inconclusive ({', '.join(unsure[:3])}): the finite "
            "differences could not tell, from rounding or a loss not differentiable at the "
            "point compared"
        )
    if res.sampled:
        alone = (
            f"compared {len(res.layers)} of {res.total_layers} layers alone, spread over the "
            "forward,"
            if res.layers
            else f"compared none of the {res.total_layers} layers alone"
        )
        joint = res.joint
        notes.append(
            f"{alone} to stay in the time budget"
            + ("; every layer at once along one random direction" if joint else "")
            + (f" ({joint.status}: not judged)" if joint and joint.status != "agree" else "")
        )
    if notes:
        record.note = "; ".join(notes)


def gradient_verdict(res: GradientResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.layers = res.layers
    record.sampled = res.sampled
    record.memory_bytes = res.memory_bytes
    record.details.update(
        dtype=res.dtype,
        layers_compared=len(res.layers),
        layers_total=res.total_layers,
        samples=res.samples,
        custom_functions=res.custom_functions,
        straight_through=res.straight_through,
        gradient_surgery=res.surgery,
        masked_rows=res.masked,
    )
    joint = res.joint
    if joint is not None:
        record.details["joint"] = {
            "autograd": joint.autograd,
            "numeric": joint.numeric,
            "error": joint.error,
            "status": joint.status,
        }
    _gradient_note(res, record)
    bad = res.mismatched()
    if not bad and joint is not None and joint.status == "mismatch":
        record.verdict = "finding"
        return _finding(
            GradientMismatch.id,
            severity,
            f"along one random direction over all {res.total_layers} layers, autograd's "
            f"derivative of the loss ({joint.autograd:.4g}) disagrees with finite differences "
            f"({joint.numeric:.4g}), but none of the {len(res.layers)} layers compared alone "
            "does: the wrong derivative is in a layer the time budget left out.",
            "Raise checks.gradient_mismatch.budget_s (or lower max_samples) to find the layer; "
            "look for a custom backward, a .data edit or an in-place change autograd does "
            "not track.",
            details={
                "layers": [],
                "joint": record.details["joint"],
                "between": [None, None],
                "custom_functions": res.custom_functions,
                "dtype": res.dtype,
            },
        )
    if not bad:
        judged = [r for r in res.layers if r.status in ("agree", "explained")]
        if not judged and (joint is None or joint.status != "agree"):  # no pass unseen
            why = f"nothing was judged: {record.note}" if record.note else "nothing was judged"
            return not_judged(GradientMismatch.id, CannotJudge("nothing_judged", why), record)
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    last = bad[-1]
    after = [r.name for r in res.layers[res.layers.index(last) + 1 :] if r.status == "agree"]
    where = f"{last.name}" + (f" and {after[0]}" if after else " and the loss")
    fns = ", ".join(res.custom_functions)
    return _finding(
        GradientMismatch.id,
        severity,
        f"autograd's derivative of the loss disagrees with finite differences for "
        f"{len(bad)} layer(s) ({', '.join(r.name for r in bad[:6])}): e.g. {last.name}: "
        f"autograd {last.autograd:.4g}, numeric {last.numeric:.4g}. The wrong derivative "
        f"is after {where}"
        + (f" (custom autograd.Function in the graph: {fns})" if fns else "")
        + ".",
        "Check the operations between "
        + where
        + ": a custom backward (try torch.autograd.gradcheck), a .data edit, an "
        "in-place change autograd does not track.",
        params=[p for r in bad for p in r.params],
        module=last.name,
        details={
            "layers": [
                {"name": r.name, "autograd": r.autograd, "numeric": r.numeric, "error": r.error}
                for r in bad
            ],
            "between": [last.name, after[0] if after else None],
            "custom_functions": res.custom_functions,
            "dtype": res.dtype,
        },
    )


def _explained_note(res: GradientResult, layers: list[str]) -> str:
    why = [f"{name}'s backward is {c:.4g} x grad_output" for name, c in res.surgery.items()]
    if res.straight_through:
        why.append("straight-through: " + ", ".join(res.straight_through))
    return (
        f"layer(s) {', '.join(layers[:6])} explained, not judged: a declared gradient "
        f"({'; '.join(why) or 'fake quantisation'})"
    )


def _leak_finding(
    leak: Leak, severity: str, leaks: list[Any], library: Optional[str] = None
) -> Finding:
    shown = ", ".join(str(p) for p in leak.reached[:8]) + (", ..." if len(leak.reached) > 8 else "")
    via = ", ".join(leak.inputs[:3])
    if leak.kind == "causal":
        message = (
            f"position {leak.position}'s output of sample {leak.sample} has a gradient on the "
            f"inputs at later position(s) {shown} (via {via}), but the model declares itself "
            f"causal ({leak.declared_by}): it sees the tokens it should predict, so it trains "
            "on a leak and fails when it generates."
        )
        hint = (
            "Check the attention mask: `tril` (not `triu`), `masked_fill(mask == 0, -inf)`, "
            "`is_causal=True` passed to scaled_dot_product_attention or nn.Transformer's "
            "causal mask; or set checks.sample_dependence.causal: false if it is not causal."
        )
    else:
        message = (
            f"sample {leak.sample}'s output at the positions its attention_mask keeps has a "
            f"gradient on its padded position(s) {shown} (via {via}): the padding changes "
            "the outputs, so a sample's result changes with how much the batch it lands in pads it."
        )
        hint = (
            "Pass attention_mask to the model; a PyTorch key_padding_mask is True where to "
            "ignore (the inverse of Hugging Face's 1-for-keep); pool with the mask "
            "(`(h * m).sum(1) / m.sum(1)`), not over every position."
        )
    details = {"sample": leak.sample, "independence": leak.kind, "declared_by": leak.declared_by}
    if leak.kind == "padding" and library is not None:
        # FNet mixes every position by design, ConvBERT's convolutions and Funnel's pooling
        # span the padding: the library's architecture, given the mask it asks for.
        severity, details["library_design"] = "info", library
        hint = (
            f"The model is {library}'s own and takes the attention_mask it was given: its "
            "architecture mixes padded positions in (a Fourier or convolution mixer, pooling "
            "across positions). Pad less (bucket by length) if results must not depend on it. "
            + hint
        )
    details.update(position=leak.position, reached_positions=leak.reached[:32], share=leak.share)
    details.update(inputs=leak.inputs, within_sample=leaks, cause=None)
    return _finding(SampleDependence.id, severity, message, hint, details=details)


def sample_verdict(
    res: SampleResult, record: ProbeResult, severity: str, library: Optional[str] = None
) -> Optional[Finding]:
    """``library``: the third-party package whose model is probed (its padding is its own)."""
    record.memory_bytes = res.memory_bytes
    record.details.update(sample=res.sample, batch=res.batch, inputs=res.inputs)
    record.details["declared"] = res.declared
    if res.not_judged:  # declared, but this model gives no way to judge it: said, not passed
        record.details["not_judged"] = res.not_judged
        record.note = "declared but not judged: " + "; ".join(
            f"{kind} ({why})" for kind, why in res.not_judged.items()
        )
    leaks = [
        {"independence": k.kind, "sample": k.sample, "position": k.position, "share": k.share}
        for k in res.leaks
    ]
    if leaks:
        record.details["within_sample"] = leaks
    if not res.dependent and not res.leaks:
        record.verdict = "passed"
        return None
    record.verdict = "finding" if res.cause is None or res.leaks else "passed"
    if res.leaks and (not res.dependent or res.cause is not None):
        # the library's design only when the user gave it the mask it asks for
        return _leak_finding(res.leaks[0], severity, leaks, library if res.mask_passed else None)
    share = "inf" if math.isinf(res.share) else f"{res.share:.3g}"
    details = {
        "sample": res.sample,
        "other_samples": res.others[:32],
        "share": res.share,
        "inputs": res.inputs,
        "cause": res.cause,
        "independence": "batch",
        "within_sample": leaks,
    }
    record.details.update(other_samples=res.others[:32], share=res.share, cause=res.cause)
    if res.cause == "batch_norm":
        return _finding(
            SampleDependence.id,
            "info",
            f"sample {res.sample}'s output depends on {len(res.others)} other sample(s) of "
            "the batch through train-mode batch norm (it vanishes with them in eval mode).",
            "Expected for BatchNorm; use GroupNorm/LayerNorm if samples must be independent.",
            details=details,
        )
    return _finding(
        SampleDependence.id,
        severity,
        f"sample {res.sample}'s output of the model has a gradient on the input of "
        f"{len(res.others)} other sample(s) of the batch of {res.batch} (via "
        f"{', '.join(res.inputs[:3])}; {share} x its own): samples change each other's "
        "outputs.",
        "Look for a softmax/normalisation over dim 0, statistics over the batch, or a "
        "reshape/view that mixes the batch with another dimension.",
        details=details,
    )


def overfit_verdict(res: OverfitResult, record: ProbeResult, severity: str) -> Optional[Finding]:
    record.curve = res.curve
    record.memory_bytes = res.memory_bytes
    record.details.update(
        start=res.start,
        floor=res.floor,
        target=res.target,
        steps=res.steps,
        optimizer=res.optimizer,
        curve_at_10x_lr=res.boosted,
    )
    if res.converged:  # a loss with no floor at 0: at its own floor, said how it was judged
        record.details.update(judged_by="convergence", no_zero_floor=res.no_zero_floor)
        record.note = (
            f"the loss has no floor at 0 ({res.no_zero_floor}), so halving it is no target: "
            f"judged by convergence, it fell from {res.start:.4g} to {res.floor:.4g} and "
            "stopped, with every layer the optimizer holds moving"
        )
    if res.learned:
        record.verdict = "passed"
        return None
    record.verdict = "finding"
    record.details["layers_that_did_not_move"] = res.not_moved
    how = "diverged (non-finite loss)" if res.diverged else f"reached only {res.floor:.4g}"
    if res.boosted:
        how += " (also at 10 x the learning rate"
        how += f", heading for {res.floor_estimate:.4g})" if res.floor_estimate else ")"
    return _finding(
        DoesNotLearn.id,
        severity,
        f"{res.steps} steps of {res.optimizer} on one fixed batch, on a copy, took the loss "
        f"from {res.start:.4g}: it {how}, not {res.target:.4g}"
        + (
            f"; {len(res.not_moved)} layer(s) did not move ({', '.join(res.not_moved[:6])})"
            if res.not_moved
            else ""
        )
        + ".",
        "A model that cannot overfit one batch has a bug: an extra softmax/sigmoid before "
        "the loss, a constant initialisation (identical units), an output range the "
        "targets are outside of, a learning rate of 0.",
        details={
            "start": res.start,
            "floor": res.floor,
            "target": res.target,
            "curve": res.curve,
            "steps": res.steps,
            "optimizer": res.optimizer,
            "diverged": res.diverged,
            "curve_at_10x_lr": res.boosted,
            "floor_estimate": res.floor_estimate,
            "layers_that_did_not_move": res.not_moved,
        },
    )
