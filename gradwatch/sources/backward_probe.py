"""``backward_probe``: one loss graph backpropagated twice into one step (``double_backward``),
from a gradient fingerprint per backward read as one device flag with the step's transfer."""

from __future__ import annotations

from typing import Any

import torch

from gradwatch.capture.grads.double_backward import BackwardProbe
from gradwatch.capture.grads.window import Track
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["BackwardProbeSource"]


class BackwardProbeSource(EvidenceSource):
    name = "backward_probe"
    serves = frozenset({"backward_probe"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        scout = ctx.scout
        self.probe = BackwardProbe(lambda: scout.ran_grad)
        self.repeated = 0  # the step being decided: backward passes that repeated another

    def install(self) -> None:
        """Each optimizer's parameters, once (under torch.compile no hook may come or go)."""
        if self.ctx.hooks.keep_all:
            return
        for track in self.ctx.structure.tracks:
            self.probe.install(track)

    def device_values(self, track: Track) -> list[torch.Tensor]:
        return self.probe.flags(track.index)

    def read(self, state: StepState, values: list[float]) -> None:
        self.repeated = int(values[-1]) if values else 0

    def window(self, state: StepState) -> dict[str, Any]:
        repeated, self.repeated = self.repeated, 0
        return {"repeated_backward": repeated}

    def remove(self) -> None:
        self.probe.remove()
