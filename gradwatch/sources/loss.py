"""What ``Tensor.backward`` is called on: the loss (``loss_value``: its finiteness, one device
flag per backward read with the step's transfer) and the loose leaves its graph trains
(``loose_leaves``: walked during the first ``scan_steps`` steps)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradwatch.capture.grads.window import Track
from gradwatch.capture.loss.loose import BackwardRoots
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["LossSource"]


class LossSource(EvidenceSource):
    name = "loss"
    serves = frozenset({"loss_value", "loose_leaves"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.roots: Optional[BackwardRoots] = None
        self._calls_at_start: dict[Optional[int], int] = {}  # per optimizer's window

    def install(self) -> None:
        if self.roots is None and self.ctx.model is not None:
            self.roots = BackwardRoots.wanted_by(self.wanted, self.ctx, self.ctx.scout)

    def note_loss(self, loss: Any) -> None:
        """An integration handed over this step's loss (``Watcher.note_loss``)."""
        if self.roots is not None:
            self.roots.note_loss(loss)

    def device_values(self, track: Track) -> list[torch.Tensor]:
        return self.roots.loss_flags() if self.roots is not None else []

    def read(self, state: StepState, values: list[float]) -> None:
        if values and self.roots is not None:
            self.roots.read(values[0])

    def window(self, state: StepState) -> dict[str, Any]:
        roots = self.roots
        if roots is None:
            return {}
        return {
            "loose": roots.take_loose(bool(self.ctx.tracker.fwd_first)),
            "loss_finite": roots.verdict(state.skipped),
        }

    def record(self, state: StepState) -> Any:
        """``{"backward_calls": n}``: ``Tensor.backward`` calls in this optimizer's window,
        counted also when the loss reaches no watched parameter (no hook sees those)."""
        if self.roots is None or state.track is None:
            return None
        return {"backward_calls": self.roots.calls - self._calls_at_start.get(state.track.index, 0)}

    def window_closed(self, k: Optional[int]) -> None:
        if self.roots is not None:
            self._calls_at_start[k] = self.roots.calls
            self.roots.window_closed()
