"""``clip_calls``: the gradient clipping calls of each window, and those that saw no
gradient (an exhausted generator, a consumed ``filter``), with the user's line
(:mod:`gradwatch.capture.loop.clip_calls`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gradwatch.capture.loop.clip_calls import ClipCalls
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["ClipSource", "ClipWindow"]


@dataclass(frozen=True)
class ClipWindow:
    """One window's clipping calls."""

    calls: int
    empty: list[tuple[str, Optional[str]]]  # (function, the user's line) of calls that saw none


class ClipSource(EvidenceSource):
    name = "clips"
    serves = frozenset({"clip_calls"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.calls = ClipCalls()

    def install(self) -> None:
        if self.ctx.model is not None:
            self.calls.install()

    def record(self, state: StepState) -> Optional[ClipWindow]:
        calls, empty = self.calls.take()
        return ClipWindow(calls, empty) if calls else None

    def remove(self) -> None:
        self.calls.remove()
