"""The evidence-source protocol: one registered unit for each kind of evidence a check needs.

A check names the evidence it judges in ``Check.needs`` (``"forward_runs"``,
``"loss_value"``, ...); each name is served by exactly one :class:`EvidenceSource`
(:mod:`gradwatch.sources.registry`). The run builds only the sources an enabled check
needs, and at each step loops over them (:class:`gradwatch.sources.SourceSet`):

1. :meth:`~EvidenceSource.install` at every layout sync (enter, ``add_optimizer``,
   ``add_param_group``, a replaced layer): hooks, or a read of the model as built;
2. :meth:`~EvidenceSource.device_values`: the device tensors it wants read at the step,
   its own named slice of the step's one host transfer;
3. :meth:`~EvidenceSource.read`: that slice back on the host (their elements as floats,
   flattened, in the same order);
4. :meth:`~EvidenceSource.window`: what it hands the checks: fields of the step's
   :class:`~gradwatch.checks.views.WindowEvidence`, and (:meth:`~EvidenceSource.record`)
   its own record, which checks read as ``view.window.records[name]``;
5. :meth:`~EvidenceSource.window_closed` when an optimizer's window closes, and
   :meth:`~EvidenceSource.remove` at exit (even on error) for every hook it added.

Every call goes through the run's fault guard: a fault in a source is an
``internal_error`` finding, never a crashed training run. The pattern is Cockpit's
quantities declaring their extensions and Lightning's ``Callback``: every method is a no-op
here, a source overrides what it uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradwatch.capture.facts import Fact
    from gradwatch.capture.forward.forward_scout import ForwardScout
    from gradwatch.capture.grads.evidence import Tracker
    from gradwatch.capture.grads.hooks import HookSet
    from gradwatch.capture.grads.window import Gathered, Track

__all__ = ["EvidenceSource", "SourceContext", "StepState"]


class SourceContext(Protocol):
    """What a source may use of the run: the step pipeline (``gradwatch.core.steps``)."""

    model: Optional[nn.Module]  # the watched model (``None`` once released)
    config: Any  # the GradWatchConfig
    structure: Any  # the layout: ``index`` (ParamIndex), ``optimizers``, ``tracks``
    tracker: Tracker  # the hot per-parameter state the gradient hooks write
    hooks: HookSet  # ``removers``: callables run at exit; ``keep_all``: under torch.compile
    faults: Any  # ``guard(where, fn, *args)``, ``callback()``: gradwatch's own faults
    scaler: Any  # the GradScaler watch (``scaler``: the user's scaler or ``None``)
    dist: Any  # the rank exchange under torch.distributed, or ``None``
    sharded: Optional[str]  # the sharding engine (FSDP1/FSDP2), or ``None``
    scout: ForwardScout  # the forward's entry hooks, shared by the forward sources
    steps: int  # optimizer steps decided so far
    backward_passes: int

    def record(self, fact: Fact) -> None:
        """A fact for the checks that judge its kind."""

    def needing(self, need: str) -> list[str]:
        """The ids of the enabled checks that need ``need``."""


@dataclass
class StepState:
    """One step being decided, as the sources see it (``track``/``gathered``: ``None`` at
    exit, when a last step the scaler skipped is read without a step)."""

    track: Optional[Track]
    gathered: Optional[Gathered]
    skipped: int = 0  # steps the GradScaler skipped in this window
    trace: Optional[dict[str, Any]] = None  # the NaN probe's trace of this window
    read: dict[str, list[float]] = field(default_factory=dict)  # each source's slice


class EvidenceSource:
    """Base class: a registered unit of evidence (see the module docstring)."""

    #: Its name: the key of its record in ``WindowEvidence.records``.
    name: ClassVar[str]
    #: The ``Check.needs`` names it serves (its own ``name`` among them).
    serves: ClassVar[frozenset[str]]
    #: Built even when no check needs it (evidence other sources and the core share).
    always: ClassVar[bool] = False

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        """``wanted``: the names it serves that enabled checks need, each with the largest
        setting asked for (``True``, or e.g. how many steps to scan)."""
        self.ctx = ctx
        self.wanted = wanted

    def wants_scout(self) -> bool:
        """Whether it needs the forward's entry hooks (``ctx.scout``) installed."""
        return False

    def blind_when_compiled(self) -> list[str]:
        """The checks (or parts of them) it leaves blind under torch.compile, where no
        forward hook of gradwatch's is added."""
        return []

    def install(self) -> None:
        """At every layout sync: add hooks (once), or read the model/optimizers as built."""

    def device_values(self, track: Track) -> list[torch.Tensor]:
        """Device tensors to read with this step's one host transfer (flattened)."""
        return []

    def read(self, state: StepState, values: list[float]) -> None:
        """Its slice of the transfer, back on the host: its tensors' elements, flattened."""

    def window(self, state: StepState) -> dict[str, Any]:
        """Fields of the step's ``WindowEvidence`` it fills."""
        return {}

    def record(self, state: StepState) -> Any:
        """Its own record for the checks (``view.window.records[name]``); ``None``: none."""
        return None

    def window_closed(self, k: Optional[int]) -> None:
        """Optimizer ``k``'s window closed (its step was decided)."""

    def after_step(self, steps: int) -> None:
        """A step was decided (``steps`` decided so far)."""

    def at_exit(self, state: StepState) -> None:
        """The run ends: a last step the scaler skipped (``state.skipped``) has no step."""

    def remove(self) -> None:
        """Remove every hook it added (idempotent)."""
