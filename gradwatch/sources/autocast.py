"""``autocast_dtypes``: which dtype each matmul-type layer produced inside an autocast region,
during the first steps (``autocast_bypassed``)."""

from __future__ import annotations

from typing import Any

from gradwatch.capture.forward.autocast_probe import AutocastProbe
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["AutocastSource"]


class AutocastSource(EvidenceSource):
    name = "autocast"
    serves = frozenset({"autocast_dtypes"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.probe = AutocastProbe()
        self._installed = False

    def install(self) -> None:
        # Under torch.compile no hook may come or go (each is a dynamo guard: a recompile).
        ctx = self.ctx
        if self._installed or ctx.model is None or ctx.hooks.keep_all:
            return
        self._installed = True
        self.probe.install(ctx.model)

    def window(self, state: StepState) -> dict[str, Any]:
        """The output dtypes seen in this window (the probe stops after its steps)."""
        seen = self.probe.take()
        self.probe.after_step()
        return {"autocast": seen}

    def remove(self) -> None:
        self.probe.remove()
