"""``discarded_passes``: micro-batches whose gradients were reset before the step that should
have used them (``step_without_grad``)."""

from __future__ import annotations

from typing import Any

from gradwatch.capture.grads.discarded import discarded_passes
from gradwatch.sources.base import EvidenceSource, StepState

__all__ = ["DiscardedSource"]


class DiscardedSource(EvidenceSource):
    name = "discarded"
    serves = frozenset({"discarded_passes"})

    def window(self, state: StepState) -> dict[str, Any]:
        if state.skipped:  # a step the GradScaler skipped drops its gradient rightly
            return {"discarded_passes": 0}
        ctx = self.ctx
        assert state.track is not None
        passes = discarded_passes(
            ctx.tracker,
            state.track,
            ctx.structure.tracks,
            exact=ctx.dist is None,
            batches=ctx.scout.batches_since(state.track.start),
        )
        return {"discarded_passes": passes}
