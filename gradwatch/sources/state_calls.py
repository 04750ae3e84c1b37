"""``state_calls``: state changes the user asked for, compared with the state at the step
(``call_without_effect``): ``strict=False`` loads that missed trained weights (made while
watching, or before and kept from import: :mod:`gradwatch._loads`), ``eval()``,
``requires_grad_(False)`` and dtype/device moves below the root undone by an ancestor before
the step (:mod:`gradwatch.capture.loop.state_calls`), and hyperparameters written where the next
``step()`` does not read them (:mod:`gradwatch.capture.loop.lr_writes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gradwatch.capture.loop.lr_writes import IgnoredWrite, LrWrites
from gradwatch.capture.loop.state_calls import Intent, Misload, StateCalls
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["StateCallsRecord", "StateCallsSource"]


@dataclass
class StateCallsRecord:
    """What one step showed of the state changes asked for since the previous one."""

    misloads: list[Misload] = field(default_factory=list)
    undone: list[Intent] = field(default_factory=list)
    ignored: list[IgnoredWrite] = field(default_factory=list)


class StateCallsSource(EvidenceSource):
    name = "state_calls"
    serves = frozenset({"state_calls"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.calls = StateCalls()
        self.writes = LrWrites()

    def install(self) -> None:
        if self.ctx.model is not None:
            self.calls.watch(self.ctx.model)
        for k, opt in enumerate(self.ctx.structure.optimizers):
            self.writes.watch(k, opt)

    def record(self, state: StepState) -> Optional[StateCallsRecord]:
        track = state.track
        ignored: list[IgnoredWrite] = []
        if track is not None and track.index is not None:
            opt = self.ctx.structure.optimizers[track.index]
            ignored = self.writes.read(track.index, opt)
        misloads, undone = self.calls.take()
        if not (misloads or undone or ignored):
            return None
        return StateCallsRecord(misloads, undone, ignored)

    def remove(self) -> None:
        self.calls.remove()
        self.writes.remove()
