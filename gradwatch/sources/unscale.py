"""``unscale_watch``: gradients edited while still scaled by the GradScaler
(``clipped_while_scaled``), seen when the scaler unscales an optimizer's gradients."""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.capture.loop.unscale_watch import UnscaleWatch
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["UnscaleSource"]


class UnscaleSource(EvidenceSource):
    name = "unscale"
    serves = frozenset({"unscale_watch"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self._watch: Optional[UnscaleWatch] = None
        self._done = False
        self.edits: dict[Optional[int], list[int]] = {}

    def install(self) -> None:
        ctx = self.ctx
        if self._done or ctx.model is None:
            return
        self._done = True
        if ctx.scaler.scaler is not None:
            guard = ctx.faults.guard
            self._watch = UnscaleWatch(
                ctx.scaler.scaler, lambda opt: guard("unscale watch", self.unscaling, opt)
            )

    def unscaling(self, optimizer: object) -> None:
        """The scaler is about to unscale ``optimizer``'s gradients: which changed while scaled?

        Under DDP the reducer writes the averaged gradients after their accumulation: the
        version counter cannot tell that from an edit, so nothing is judged there.
        """
        ctx = self.ctx
        if ctx.dist is not None:
            return
        opts = ctx.structure.optimizers
        k = next(
            (
                j
                for j, o in enumerate(opts)
                if o is optimizer or o is getattr(optimizer, "optimizer", None)
            ),
            None,
        )
        track = ctx.structure.track_of(k) if k is not None else None
        if track is None:
            return
        t, start = ctx.tracker, track.start
        edited = []
        for i, p in zip(track.ids, track.params):
            g = p.grad
            if g is None or t.last_seq[i] <= start or g._base is not None:
                continue
            if t.acc_ref[i]() is not g or g._version != t.acc_ver[i]:
                edited.append(i)
        self.edits[k] = edited

    def window(self, state: StepState) -> dict[str, Any]:
        assert state.track is not None
        return {"scaled_edits": self.edits.pop(state.track.index, None)}

    def remove(self) -> None:
        if self._watch is not None:
            self._watch.remove()
