"""``scheduler_counts``: how often each LR scheduler of an optimizer stepped per optimizer
step (``scheduler_misstepped``)."""

from __future__ import annotations

from typing import Any

from gradwatch.capture.loop.schedulers import SchedulerCounts
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["SchedulerSource"]


class SchedulerSource(EvidenceSource):
    name = "schedulers"
    serves = frozenset({"scheduler_counts"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.counts = SchedulerCounts()

    def window(self, state: StepState) -> dict[str, Any]:
        track = state.track
        assert track is not None
        ctx = self.ctx
        steps: list[tuple[int, bool]] = []
        if track.index is not None:
            opt = ctx.structure.optimizers[track.index]
            steps = self.counts.read(track.index, opt, track.steps == 0)
        # A step the GradScaler skipped still steps the schedule; accelerate steps it once
        # per process.
        world = ctx.dist.world_size if ctx.dist is not None else 1
        return {"scheduler_steps": steps, "scheduler_allowed": (1 + state.skipped) * world}
