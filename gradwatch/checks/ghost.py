"""``ghost_param``: a trainable parameter got no gradient while others did."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView, StructureView
from gradwatch.errors import GhostLayerError

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

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
    " It is missing in some steps only (a branch taken sometimes: MoE routing, LayerDrop), "
    "which is fine in one process; DDP needs find_unused_parameters=True for it."
)


class GhostParamConfig(CheckConfig):
    """``ghost_param``: a trainable parameter got no gradient in a step while others did."""

    severity: Severity = severity_field("error")
    intermittent_severity: Severity = Field(
        default="info",
        description="Severity of an intermittent ghost (missing in some steps, present in "
        "others: MoE routing, LayerDrop) in a single process or under DDP with "
        "find_unused_parameters=True. Under DDP without it (the job crashes) and for a "
        "permanent ghost: `severity`.",
    )


class GhostParam(Check):
    """Names parameters that received no gradient between two steps of their optimizer.

    A permanent ghost (never received a gradient) has the check's ``severity``. An
    intermittent one (MoE routing, LayerDrop) has ``intermittent_severity`` (``info``) in a
    single process or under DDP with ``find_unused_parameters=True``, and ``severity`` under
    DDP without it, where it crashes the job. A layer first reported as permanent that later
    receives a gradient is rewritten as intermittent.
    """

    id = "ghost_param"
    Config = GhostParamConfig
    keeps_forward_hooks = True
    error = GhostLayerError
    doc = CheckDoc(
        summary="A trainable parameter got no gradient between two optimizer steps while "
        "others did.",
        why="The optimizer holds it but it never learns: it keeps its initial values, wastes "
        "memory, and under DDP without find_unused_parameters=True the job crashes with "
        "'Expected to have finished reduction'. A permanent ghost is an error; an intermittent one "
        "(MoE routing, LayerDrop: a branch taken sometimes) is info in one process or under "
        "DDP with find_unused_parameters=True, and an error under DDP without it.",
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
    config: GhostParamConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._ddp_strict = False  # under DDP without find_unused_parameters
        self._flagged: dict[str, list[int]] = {}  # layer -> its ghosts at their last report
        self._pos: tuple[object, dict[int, int]] = (None, {})

    @classmethod
    def call_site(cls, finding: Any) -> Optional[str]:
        """A layer that ran but was cut off (or ran under no_grad): the line that called it."""
        if finding.details.get("cause") in ("disconnected", "no_grad"):
            return finding.module  # type: ignore[no-any-return]
        return None

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._ddp_strict = view.extra.get("ddp_find_unused") is False

    def _severity(self, intermittent: bool) -> str:
        if intermittent and not self._ddp_strict:
            return self.config.intermittent_severity
        return self.severity

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.ranks_missing is not None:
            missing = [bool(r) for r in view.ranks_missing]
        elif view.written:  # a gradient written by hand is a gradient
            missing = [not a and not w for a, w in zip(view.arrived, view.written)]
        else:
            missing = [not a for a in view.arrived]
        # No gradient anywhere (on any rank: under DDP ``arrived`` is global) is a step
        # without backward, not a ghost.
        if not any(view.arrived):
            return
        if self._flagged:
            self._revise(view, missing, log)
        if not any(missing):
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
            ids = [view.ids[k] for k in ghosts]
            names = view.index.names(ids)
            where = ""
            if view.ranks_missing is not None and len(details["ranks"]) < view.world_size:  # type: ignore[arg-type]
                where = f" on rank(s) {details['ranks']}"
            self._flagged[layer] = ids
            log.emit(
                self.id,
                severity=self._severity(intermittent),
                step=view.step,
                message=_message(len(names), layer, lost, seen, view.step, where, cause),
                hint=HINTS.get(cause, HINTS["unknown"]) + (INTERMITTENT if intermittent else ""),
                params=names,
                module=layer,
                details=details,
            )

    def _revise(self, view: StepView, missing: list[bool], log: FindingLog) -> None:
        """Reported layers whose ghosts got a gradient now: intermittent, with the latest counts.

        Keeps a finding true at any time: a layer missing at step 0 only is not left
        described as a permanent ghost, and ``steps_seen`` keeps counting.
        """
        ids = view.ids
        if self._pos[0] is not ids:  # the track's id list is reused while the layout holds
            self._pos = (ids, {i: k for k, i in enumerate(ids)})
        pos = self._pos[1]
        for layer, ghost_ids in self._flagged.items():
            ks = [pos[i] for i in ghost_ids if i in pos]
            if not ks or any(missing[k] for k in ks):
                continue
            k0 = ks[0]
            seen, lost = view.seen[k0], view.missing[k0]
            finding = log.get(self.id, layer)
            if finding is None:
                continue
            cause = str(finding.details.get("cause", "unknown"))
            log.revise(
                self.id,
                layer,
                severity=self._severity(True),
                message=_message(len(finding.params), layer, lost, seen, view.step, "", cause),
                hint=HINTS.get(cause, HINTS["unknown"]) + INTERMITTENT,
                details={"steps_missing": lost, "steps_seen": seen, "intermittent": True},
            )


def _message(n: int, layer: str, lost: int, seen: int, step: int, where: str, cause: str) -> str:
    when = f"in {lost} of {lost + seen} steps" if seen else f"at step {step}"
    noun = "parameter" if n == 1 else "parameters"
    return f"{n} {noun} of '{layer}' got no gradient {when}{where} (cause: {cause})."
