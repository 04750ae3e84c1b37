"""``discarded_passes``: micro-batches whose gradients were reset before the step that should
have used them (``step_without_grad``)."""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.capture.grads.discarded import discarded_passes, hear_other_steps
from gradwatch.capture.grads.spans import count_after
from gradwatch.sources.base import EvidenceSource, StepState

__all__ = ["DiscardedSource"]


class DiscardedSource(EvidenceSource):
    name = "discarded"
    serves = frozenset({"discarded_passes"})
    _remove: Any = None

    def install(self) -> None:
        if self._remove is None:  # once: a GAN's other half watched by another watcher
            ctx = self.ctx
            self._remove = hear_other_steps(
                ctx.tracker, lambda: ctx.structure.tracks, ctx.faults.callback()
            )

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

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
            batches=_training_batches(ctx.scout, state.track.start),
        )
        return {"discarded_passes": passes}


def _training_batches(scout: Any, start: int) -> Optional[int]:
    """The window's batches, less those whose forward wanted its inputs' gradient: FGSM's
    ``loss.backward()`` fills ``delta.grad`` and the weights' ``.grad`` alike, and the reset
    before the training backward drops only what that backward left (Wong et al. 2020)."""
    batches = scout.batches_since(start)
    wanted_input_grad = count_after(scout.input_grad_starts, start)
    return None if batches is None else batches - wanted_input_grad
