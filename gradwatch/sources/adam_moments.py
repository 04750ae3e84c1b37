"""``adam_moments``: how much of each Adam-family param group's step its ``eps`` decides.

Once, after step ``S`` (the setting, 4 by default: the second moment has seen a few
gradients), each group's ``exp_avg_sq`` is compared with its ``eps`` on device
(:func:`gradwatch.measure.moments.eps_dominance`): two scalars per group, read with the
step's one transfer. Optimizers without ``exp_avg_sq``, or with a quantized one (8-bit
states), give nothing to read and are not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from gradwatch.capture.grads.window import Track
from gradwatch.measure.moments import eps_dominance
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["AdamMomentsSource", "EpsShare"]


@dataclass(frozen=True)
class EpsShare:
    """One param group's measured elements, and those where ``eps >= sqrt(v_hat)``."""

    optimizer: int
    group: int
    eps: float
    dominated: int
    measured: int
    step: int


class AdamMomentsSource(EvidenceSource):
    name = "adam_moments"
    serves = frozenset({"adam_moments"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        at = wanted.get("adam_moments", 4)
        self.at = at if isinstance(at, int) and at >= 0 else 4
        self.shares: list[EpsShare] = []
        self._pending: list[tuple[int, int, float]] = []

    def device_values(self, track: Track) -> list[torch.Tensor]:
        self._pending = []
        if track.steps != self.at or track.index is None or track.ref is None:
            return []
        opt = track.ref()
        out = []
        for g, group in enumerate(getattr(opt, "param_groups", None) or []):
            counts = eps_dominance(opt, group)
            if counts is not None:
                out.append(counts)
                self._pending.append((track.index, g, float(group["eps"])))
        return out

    def read(self, state: StepState, values: list[float]) -> None:
        if not self._pending or len(values) != 2 * len(self._pending) or state.track is None:
            return
        step = state.track.steps
        for n, (k, g, eps) in enumerate(self._pending):
            dominated, measured = int(values[2 * n]), int(values[2 * n + 1])
            self.shares.append(EpsShare(k, g, eps, dominated, measured, step))

    def record(self, state: StepState) -> Optional[list[EpsShare]]:
        if not self.shares:
            return None
        shares, self.shares = self.shares, []
        return shares
