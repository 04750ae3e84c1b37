"""``zero_grad_watch``: gradients changed after the step that consumed them, seen at each
watched optimizer's ``zero_grad`` (``clip_after_step``)."""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.capture.loop.zero_grad_watch import AfterStepEdits, ZeroGradWatch
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["ZeroGradSource"]


class ZeroGradSource(EvidenceSource):
    name = "zero_grad"
    serves = frozenset({"zero_grad_watch"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.edits: Optional[AfterStepEdits] = None
        self._watch: Optional[ZeroGradWatch] = None

    def install(self) -> None:
        """At every sync: an optimizer added during the run is covered too (once each)."""
        ctx = self.ctx
        if not ctx.structure.optimizers:
            return
        if self._watch is None:
            edits = self.edits = AfterStepEdits(
                ctx.tracker, ctx.structure.track_of, lambda: ctx.backward_passes
            )
            guard = ctx.faults.guard
            self._watch = ZeroGradWatch([], lambda k: guard("zero_grad watch", edits.zeroing, k))
        self._watch.cover(ctx.structure.optimizers)

    def window(self, state: StepState) -> dict[str, Any]:
        assert state.track is not None
        if self.edits is None:
            return {}
        return {"edited_after_step": self.edits.take(state.track.index)}

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
