"""GradScaler accounting: each drop of the loss scale is a step the scaler skipped."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from gradwatch.capture.facts import SKIPPED_STEPS, Fact

__all__ = ["ScalerWatch"]


class ScalerWatch:
    """Counts the optimizer steps a ``torch.amp.GradScaler`` skipped (its scale fell)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.skipped = 0
        # The scale before any step: skips before the first successful step count too.
        scale0 = getattr(scaler, "_scale", None)
        self._last: Optional[float] = (
            float(scale0)
            if isinstance(scale0, torch.Tensor)
            else getattr(scaler, "_init_scale", None)
        )

    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The scaler's current scale, still on its device (read with the step's transfer)."""
        scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        return scale if isinstance(scale, torch.Tensor) else None

    def note(self, scale: Optional[float]) -> int:
        """The number of steps skipped since the last scale seen (0 when none)."""
        if scale is None:
            return 0
        last, self._last = self._last, scale
        if last is None or scale >= last:
            return 0
        backoff = float(getattr(self.scaler, "_backoff_factor", 0.5)) or 0.5
        skipped = max(1, round(math.log(last / scale) / math.log(1.0 / backoff)))
        self.skipped += skipped
        return skipped

    def note_current(self) -> int:
        """:meth:`note` on the current scale (at exit: the last step's skip)."""
        scale = self.scale_tensor()
        return self.note(float(scale)) if scale is not None else 0

    def skip_fact(self, skipped: int, step: int, trace: Optional[dict[str, Any]]) -> Optional[Fact]:
        """Steps the scaler skipped (inf/NaN gradients) as a fact for the checks to judge, with
        the NaN probe's ``trace`` of the window (``None`` when nothing was skipped)."""
        if not skipped:
            return None
        details = {"skipped": skipped, "total": self.skipped, "trace": trace}
        return Fact(SKIPPED_STEPS, step=step, key="grad_scaler", message="", details=details)
