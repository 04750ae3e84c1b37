"""``samples``: the samples behind a step's gradient (the batches the watched model's training
forwards began in the window, times the latest one's leading dim): at batch size 1 every
gradient is a single sample's (``dead_param``'s patience, ``exploding_grad``'s spike
reference)."""

from __future__ import annotations

from typing import Any

from gradwatch.sources.base import EvidenceSource, StepState

__all__ = ["SamplesSource"]


class SamplesSource(EvidenceSource):
    name = "samples"
    serves = frozenset({"samples"})

    def wants_scout(self) -> bool:
        return True

    def window(self, state: StepState) -> dict[str, Any]:
        scout = self.ctx.scout
        rows = scout.rows
        if state.track is None or rows is None:
            return {}
        batches = scout.batches_since(state.track.start)
        return {"samples": rows * batches if batches else None}
