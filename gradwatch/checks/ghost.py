"""``ghost_param``: a trainable parameter got no gradient while others did."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks.base import Check, StepView
from gradwatch.checks.docs import CheckDoc

if TYPE_CHECKING:
    from gradwatch.core.findings import FindingLog

HINTS = {
    "not_called": "Its module never ran: remove the unused layer or call it; if the branch is "
    "conditional, DDP needs find_unused_parameters=True. List it in `ignore` if intended.",
    "no_grad": "Its module ran with gradients disabled (torch.no_grad, torch.inference_mode, or a "
    "reentrant torch.utils.checkpoint whose inputs do not require grad: use "
    "checkpoint(..., use_reentrant=False)). Freeze it with requires_grad_(False) if intended.",
    "disconnected": "Its module ran with gradients enabled but its output never reached the loss: "
    "look for .detach(), .data, a .item()/.numpy() round trip, or an output nobody used "
    "(e.g. an ignored pooler).",
    "unknown": "No gradient reached it and its module could not be traced (a functional call or "
    "a parameter used outside its module). Check that it contributes to the loss.",
}
INTERMITTENT = (
    " It is missing in some steps only (a branch taken sometimes): DDP needs "
    "find_unused_parameters=True for this."
)


class GhostParam(Check):
    """Names parameters that received no gradient between two steps of their optimizer."""

    id = "ghost_param"
    doc = CheckDoc(
        summary="A trainable parameter got no gradient between two optimizer steps while "
        "others did.",
        why="The optimizer holds it but it never learns: it keeps its initial values, wastes "
        "memory, and under DDP without find_unused_parameters=True the job crashes with "
        "'Expected to have finished reduction'. An intermittent ghost (a branch taken "
        "sometimes) is fine in one process but not under that DDP setting.",
        causes=(
            "not_called: a layer built in __init__ that forward() never calls (a forgotten "
            "auxiliary head, a renamed attribute).",
            "no_grad: its module ran under torch.no_grad()/inference_mode, or inside a "
            "reentrant torch.utils.checkpoint whose inputs do not require grad.",
            "disconnected: it ran with gradients on, but its output never reached the loss "
            "(.detach(), .data, a .item()/.numpy() round trip, an ignored pooler output).",
            "unknown: a functional call or a parameter used outside its module.",
        ),
        fix="Follow details.cause and the source lines in the finding (defined_at: where the "
        "layer is created; called_at: the line that called it). Call the layer, remove it, "
        "freeze it (requires_grad_(False)) if it is not meant to train, or use "
        "checkpoint(..., use_reentrant=False).",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.ranks_missing is not None:
            missing = [bool(r) for r in view.ranks_missing]
        else:
            missing = [not a for a in view.arrived]
        # No gradient anywhere (on any rank: under DDP ``arrived`` is global) is a step
        # without backward, not a ghost.
        if not any(missing) or not any(view.arrived):
            return
        for layer, positions in view.by_layer().items():
            ghosts = [k for k in positions if missing[k]]
            if not ghosts:
                continue
            k0 = ghosts[0]
            i0 = view.ids[k0]
            cause = view.cause(i0)
            seen, lost = view.seen[k0], view.missing[k0]
            intermittent = seen > 0
            details: dict[str, object] = {
                "cause": cause,
                "steps_missing": lost,
                "steps_seen": seen,
                "intermittent": intermittent,
            }
            if view.optimizer is not None:
                details["optimizer"] = view.optimizer
            if view.ranks_missing is not None:
                ranks = sorted({r for k in ghosts for r in view.ranks_missing[k]})
                details["ranks"] = ranks
                details["world_size"] = view.world_size
            names = view.index.names([view.ids[k] for k in ghosts])
            when = f"in {lost} of {lost + seen} steps" if intermittent else f"at step {view.step}"
            where = ""
            if view.ranks_missing is not None and len(details["ranks"]) < view.world_size:  # type: ignore[arg-type]
                where = f" on rank(s) {details['ranks']}"
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"{len(names)} parameter{'' if len(names) == 1 else 's'} of '{layer}' got no gradient {when}{where} "
                f"(cause: {cause}).",
                hint=HINTS.get(cause, HINTS["unknown"]) + (INTERMITTENT if intermittent else ""),
                params=names,
                module=layer,
                details=details,
            )
