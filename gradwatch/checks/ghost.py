"""``ghost_param``: a trainable parameter got no gradient while others did."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks._ghost_groups import Group, ghost_groups
from gradwatch.checks._grouping import numel_of
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView, StructureView
from gradwatch.errors import GhostLayerError

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

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
    library_severity: Severity = Field(
        default="info",
        description="Severity of a ghost that a third-party library's own model, watched as "
        "it is, makes and leaves out by design (a Hugging Face masked LM's pooler, a "
        "decoder's cross-attention run alone, an indexer its forward runs under no_grad), in "
        "a single process or under DDP with find_unused_parameters=True. Under DDP without "
        "it: `severity`.",
    )


#: A module not called while its siblings in the same container were (a routed expert that got
#: no token) is held at ``intermittent_severity`` for this many steps without any gradient
#: before it is called a permanent ghost: top-k routing leaves experts idle for a few steps by
#: design, and at step 0 nothing tells such an expert from a forgotten list element. Eight
#: steps: an expert a uniform router over 4 experts skips for 8 steps of 3 tokens has a chance
#: of (3/4)^24 = 0.1 %; a router that never picks it is a bug (a collapsed or masked router).
ROUTED_STEPS = 8
#: Blocks are not experts: when the elements run in a chain (each one's input a sibling's
#: output: a stack of blocks), or the idle one ran with only its trainable part left out (a
#: frozen base whose adapter was switched off), the same one idle this many steps in a row while
#: every other ran is a block cut off (a loop over ``blocks[:-1]``), where LayerDrop or
#: AdapterDrop skips a different one each step. Experts run side by side and the same one can
#: be left out while every other gets a token for several steps (a router that starts
#: unbalanced): they wait for ``ROUTED_STEPS``.
SOLO_STEPS = 3
ROUTED = (
    " Its siblings in '{parent}' were called in the same step: a routed expert that got no "
    "token is idle by design; if it never gets a gradient in {n} steps it is reported as a "
    "permanent ghost."
)

LIBRARY = (
    " It is inside {pkg}'s own model, whose forward leaves it out by design (this code is "
    "not yours): freeze it with requires_grad_(False) if it is not meant to train; under "
    "DDP, find_unused_parameters=True (Hugging Face's Trainer sets it for its models)."
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
    maturity = "stable"
    Config = GhostParamConfig
    keeps_forward_hooks = True
    counts_toward_share = True
    error = GhostLayerError
    doc = CheckDoc(
        summary="A trainable parameter got no gradient between two optimizer steps while "
        "others did.",
        why="The optimizer holds it but it never learns: it keeps its initial values, wastes "
        "memory, and under DDP without find_unused_parameters=True the job crashes with "
        "'Expected to have finished reduction'. A permanent ghost is an error; an intermittent one "
        "(MoE routing, LayerDrop: a branch taken sometimes) is info in one process or under "
        "DDP with find_unused_parameters=True, and an error under DDP without it. When the "
        "watched model is a third-party library's own (a Hugging Face masked LM), a ghost its "
        "code made and its forward leaves out (the pooler, a decoder's cross-attention run "
        "alone) is that library's design and `library_severity` (info), except under DDP "
        "without find_unused_parameters; the user's own model around a library's, a module "
        "set on it from outside or a forward the user replaced is the user's ghost.",
        causes=(
            "not_called: a layer built in __init__ that forward() never calls (a forgotten "
            "auxiliary head, a renamed attribute).",
            "no_grad: its module ran under torch.no_grad()/inference_mode, or inside a "
            "reentrant torch.utils.checkpoint whose inputs do not require grad.",
            "disconnected: it ran with gradients on, but its output never reached the loss "
            "(.detach(), .data, a .item()/.numpy() round trip, an ignored pooler output).",
            "not_in_model: the optimizer holds a tensor that is no longer in the model (a "
            "layer replaced after the optimizer was built: details.replaced names it).",
            "unknown: a functional call or a parameter used outside its module.",
        ),
        fix="The layers of one cause are one finding: details.cut names the module whose "
        "output one .detach() cut off (details.layers: every layer it severed). "
        "Follow details.cause and the source lines in the finding (defined_at: where the "
        "layer is created; called_at: the line that called it). Call the layer, remove it, "
        "freeze it (requires_grad_(False)) if it is not meant to train, or use "
        "checkpoint(..., use_reentrant=False).",
        detail="a trainable parameter got no gradient between two steps of its optimizer while "
        "others did. `details.cause`: `not_called`, `no_grad` (incl. `inference_mode` and "
        "reentrant checkpoints), `disconnected` (`.detach()`, an unused output), `unknown`. A "
        "permanent ghost (never a gradient) is an error; an intermittent one (`steps_seen` > 0: "
        "MoE routing, LayerDrop) is `intermittent_severity` (`info`) in one process or under DDP "
        "with `find_unused_parameters=True`, and an error under DDP without it (the job crashes). "
        "A finding always describes the latest state (a layer missing at step 0 only becomes "
        "intermittent). One cause, one finding: the layers one `.detach()` cut off are one "
        "finding, `details.cut` naming the module whose output was detached; a subtree never "
        "called or run under `no_grad` is one finding named by it; a layer replaced after the "
        "optimizer was built is `details.cause: not_in_model` (`details.replaced`). Inside a "
        "library's own model (a Hugging Face pooler that a masked LM never reads) it is "
        "`library_severity` (`info`), `details.library_design` naming the package. A numbered "
        "element of a `ModuleList` not called while elements of the same layout were (a routed "
        "expert that got no token) is `intermittent_severity` until it has missed 8 steps "
        "without ever getting a gradient (a router that starts unbalanced can leave one expert "
        "idle for steps while every other gets tokens); then it is a permanent ghost, an error "
        "live and in the report (a collapsed router), and `fail_fast` stops there. When the "
        "elements run in a chain (one's input is another's output, read from the forward's "
        "data flow: a stack of blocks, not experts), or the idle one ran with only its trainable "
        "part left out (an adapter switched off over a frozen base), the same one idle for 3 "
        "steps in a row while every other ran is a block cut off (a loop that stops one short) "
        "and a permanent ghost then; LayerDrop and AdapterDrop skip a different one each step. "
        "`details.routed_siblings` names the container while held; a ghost called in a later "
        "step is intermittent",
    )
    config: GhostParamConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._ddp_strict = False  # under DDP without find_unused_parameters
        self._flagged: dict[str, tuple[list[int], Group]] = {}  # key -> its ghosts, group
        self._pos: tuple[object, dict[int, int]] = (None, {})
        self._library: dict[str, str] = {}  # library-owned module -> its package
        self._routed: dict[str, bool] = {}  # groups held back as routed experts (ROUTED_STEPS)
        self._solo: dict[str, int] = {}  # steps in a row a held group alone missed its call

    @classmethod
    def call_site(cls, finding: Any) -> Optional[str]:
        """A layer that ran but was cut off (or ran under no_grad): the line that called it."""
        if finding.details.get("cause") in ("disconnected", "no_grad"):
            return finding.module  # type: ignore[no-any-return]
        return None

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._ddp_strict = view.extra.get("ddp_find_unused") is False
        self._library = view.extra.get("library_owned") or {}

    def _library_of(self, group: Group) -> Optional[str]:
        """The package whose own model holds ``group``, its top module and every layer (None:
        user code). ``bert`` run under no_grad by the user's forward is the user's ghost,
        though every layer under it is the library's; so is a LoRA layer whose forward the
        user replaced, though the block above it is the library's."""
        tops = [group.module, *group.layers] if group.module else group.layers
        pkgs = {self._library.get(layer) for layer in tops}
        if len(pkgs) != 1 or None in pkgs or self._ddp_strict:
            return None
        return pkgs.pop()

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
        flagged = []
        layers = view.by_layer()
        for layer, positions in layers.items():
            ghosts = [k for k in positions if missing[k]]
            if ghosts:
                flagged.append((layer, ghosts, view.cause(view.ids[ghosts[0]])))
        for group in ghost_groups(view, flagged):
            self._emit(view, group, log, layers)

    def _emit(
        self, view: StepView, group: Group, log: FindingLog, layers: dict[str, list[int]]
    ) -> None:
        ks = group.positions
        k0 = ks[0]
        seen, lost = view.seen[k0], view.missing[k0]
        intermittent = seen > 0
        details: dict[str, object] = {
            "cause": group.cause,
            "steps_missing": lost,
            "steps_seen": seen,
            "intermittent": intermittent,
            "numel": numel_of(view.index, (view.ids[k] for k in ks)),
        }
        details.update(group.details)
        if view.optimizer is not None:
            details["optimizer"] = view.optimizer
        where = ""
        if view.ranks_missing is not None:
            ranks = sorted({r for k in ks for r in view.ranks_missing[k]})
            details["ranks"] = ranks
            details["world_size"] = view.world_size
            if len(ranks) < view.world_size:
                where = f" on rank(s) {ranks}"
        ids = [view.ids[k] for k in ks]
        names = view.index.names(ids)
        self._flagged[group.key] = (ids, group)
        severity, hint = self._severity(intermittent), group.hint()
        parent = None
        if not intermittent and lost < ROUTED_STEPS:
            parent, every, blocks = _routed(view, group, layers)
            solo = self._solo.get(group.key, 0) + 1 if every and blocks else 0
            self._solo[group.key] = solo
            if solo >= SOLO_STEPS:
                parent = None
        if parent is not None and not self._ddp_strict:
            severity = self.config.intermittent_severity
            hint += ROUTED.format(parent=parent, n=ROUTED_STEPS)
            details["routed_siblings"] = parent
            self._routed[group.key] = True
        elif self._routed.pop(group.key, False) and not intermittent:
            message = group.message(len(names), lost, seen, view.step, where)
            log.revise(
                self.id, group.key, severity=severity, message=message, hint=hint, details=details
            )
        library = self._library_of(group)
        if library is not None:
            details["library_design"] = library
            hint += LIBRARY.format(pkg=library)
            if not intermittent:
                severity = self.config.library_severity
        log.emit(
            self.id,
            severity=severity,
            step=view.step,
            message=group.message(len(names), lost, seen, view.step, where),
            hint=hint + (INTERMITTENT if intermittent else ""),
            params=names,
            module=group.module,
            details=details,
            key=group.key,
        )

    def _revise(self, view: StepView, missing: list[bool], log: FindingLog) -> None:
        """Reported groups whose ghosts got a gradient now: intermittent, with the latest counts.

        Keeps a finding true at any time: a layer missing at step 0 only is not left
        described as a permanent ghost, and ``steps_seen`` keeps counting.
        """
        ids = view.ids
        if self._pos[0] is not ids:  # the track's id list is reused while the layout holds
            self._pos = (ids, {i: k for k, i in enumerate(ids)})
        pos = self._pos[1]
        for key, (ghost_ids, group) in self._flagged.items():
            ks = [pos[i] for i in ghost_ids if i in pos]
            if not ks or any(missing[k] for k in ks):
                continue
            k0 = ks[0]
            seen, lost = view.seen[k0], view.missing[k0]
            finding = log.get(self.id, key)
            if finding is None:
                continue
            log.revise(
                self.id,
                key,
                severity=self._severity(True),
                message=group.message(len(finding.params), lost, seen, view.step, ""),
                hint=group.hint() + INTERMITTENT,
                details={"steps_missing": lost, "steps_seen": seen, "intermittent": True},
            )


def _suffixes(layers: list[str], prefix: str) -> frozenset[str]:
    return frozenset(layer[len(prefix) :] for layer in layers)


def _routed(
    view: StepView, group: Group, layers: dict[str, list[int]]
) -> tuple[Optional[str], bool, bool]:
    """The container whose other elements of the same layout were called this step, when the
    ghost is one element of it that was not (``experts.2`` idle while ``experts.0`` ran): the
    evidence of routing; whether every other element was called; and whether the elements are
    blocks, not experts (the called ones form a chain, or this one ran with its trainable part
    left out). Elements are numbered (a ``ModuleList``); a named module that was not called
    stays a ghost at once."""
    module = group.module or (group.layers[0] if len(group.layers) == 1 else None)
    if group.cause != "not_called" or not module:
        return None, False, False
    parent, _, own = module.rpartition(".")
    if not parent or not own.isdigit():
        return None, False, False
    mine = [x for x in group.layers if x == module or x.startswith(module + ".")]
    layout = _suffixes(mine, module)
    others: dict[str, list[str]] = {}
    called: set[str] = set()
    for layer, positions in layers.items():  # the step's grouping, made once (on_step)
        seg = _element(layer, parent)
        if seg is None or seg == own:
            continue
        others.setdefault(seg, []).append(layer)
        if any(view.arrived[k] for k in positions):
            called.add(seg)
    alike = {seg for seg in others if _suffixes(others[seg], f"{parent}.{seg}") == layout}
    if not alike & called:
        return None, False, False
    blocks = _chained(view, parent, alike & called, others) or _entered(view, module, mine)
    return parent, alike <= called, blocks


def _element(layer: str, parent: str) -> Optional[str]:
    """The number of the element of ``parent`` that holds ``layer`` (None: none does)."""
    if not layer.startswith(parent + "."):
        return None
    seg = layer[len(parent) + 1 :].split(".", 1)[0]
    return seg if seg.isdigit() else None


def _chained(view: StepView, parent: str, called: set[str], others: dict[str, list[str]]) -> bool:
    """Whether a called element's input came from another element of ``parent`` (the forward's
    data flow of the first window): ``blocks.1`` fed by ``blocks.0``. Experts read the same
    input side by side; unknown flow (a compiled model) is no chain."""
    links = view.forward.links
    for seg in called:
        for layer in others[seg]:
            for up in links.get(layer, ()):
                other = _element(up, parent)
                if other is not None and other != seg:
                    return True
    return False


def _entered(view: StepView, module: str, ghosts: list[str]) -> bool:
    """Whether a layer of the element ``module`` other than its ghost layers ran this step (its
    frozen base: an adapter switched off inside a block that ran). An expert that got no token
    runs no part of itself."""
    skip = set(ghosts)
    for layer, ids in view.index.layers.items():
        if layer in skip or not ids or not (layer == module or layer.startswith(module + ".")):
            continue
        if view.cause(ids[0]) in ("disconnected", "no_grad"):
            return True
    return False
