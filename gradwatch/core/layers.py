"""Running per-layer statistics and their conversion into report rows."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from gradwatch.checks.views import LayerSample
from gradwatch.results import LayerStats


@dataclass
class LayerTrack:
    """What the report keeps about one layer, updated on observed steps."""

    history_len: int
    last: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    total: float = 0.0
    count: int = 0
    mean_abs: Optional[float] = None
    max_abs: Optional[float] = None
    zero_fraction: Optional[float] = None
    param_norm: Optional[float] = None
    update_ratio: Optional[float] = None
    history: deque[tuple[int, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.history_len)

    def update(self, step: int, s: LayerSample) -> None:
        n = s.norm
        self.last = n
        if math.isfinite(n):
            if self.min is None or n < self.min:  # comparisons: cheaper than min()/max()
                self.min = n
            if self.max is None or n > self.max:
                self.max = n
            self.total += n
            self.count += 1
        self.mean_abs = s.mean_abs
        self.max_abs = s.max_abs
        self.zero_fraction = 1.0 - s.nonzero / s.numel if s.numel else None
        self.param_norm = s.param_norm
        if s.delta_norm is not None and s.param_norm:
            self.update_ratio = s.delta_norm / s.param_norm
        self.history.append((step, n))

    def to_stats(self, name: str, params: list[str], numel: int, **extra: object) -> LayerStats:
        return LayerStats(
            name=name,
            params=params,
            numel=numel,
            grad_norm_last=self.last,
            grad_norm_min=self.min,
            grad_norm_max=self.max,
            grad_norm_mean=self.total / self.count if self.count else None,
            mean_abs_grad=self.mean_abs,
            max_abs_grad=self.max_abs,
            zero_fraction=self.zero_fraction,
            param_norm=self.param_norm,
            update_ratio=self.update_ratio,
            history=list(self.history),
            **extra,  # type: ignore[arg-type]
        )
