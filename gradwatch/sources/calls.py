"""Backward requests an integration reports (Lightning's ``on_before_backward``): a batch whose
``training_step`` returned ``None`` still steps the optimizer, and is no ``loss_disconnected``.
"""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["BackwardCallsSource"]


class BackwardCallsSource(EvidenceSource):
    name = "backward_calls"
    serves = frozenset()
    always = True  # counted only where an integration sees them (else "unknown")

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.calls: Optional[int] = None
        self._at_start: dict[Optional[int], int] = {}

    def note(self) -> None:
        """An integration saw ``backward()`` requested."""
        self.calls = (self.calls or 0) + 1

    def window(self, state: StepState) -> dict[str, Any]:
        if self.calls is None:
            return {}
        assert state.track is not None
        return {"backward_called": self.calls > self._at_start.get(state.track.index, 0)}

    def window_closed(self, k: Optional[int]) -> None:
        self._at_start[k] = self.calls or 0
