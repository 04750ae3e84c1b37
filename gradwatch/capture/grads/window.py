"""A window: one optimizer's watched parameters between two of its steps, and one step's reads.

:class:`Track` is laid out by the run's structure (``core/structure.py``) and carried from
step to step; :class:`Gathered` is what one step read of it (``core/gather.py`` or, sharded,
``distributed/gather.py``), on the host, aligned with the track's positions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gradwatch.measure.fingerprint import Fingerprint

__all__ = ["Gathered", "Track"]


@dataclass
class Track:
    """One optimizer (or, without one, the backward passes): its parameters and window."""

    index: Optional[int]
    ref: Optional[weakref.ref[Any]] = None
    ids: list[int] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    layer_positions: dict[str, list[int]] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)
    layer_of: list[str] = field(default_factory=list)
    start: int = 0
    steps: int = 0
    backward_at_start: int = 0
    signature: tuple[int, ...] = ()
    # Copy-free "what changed across the step" (measure/fingerprint.py), taken on observed steps.
    fingerprint: Optional[Fingerprint] = None
    # Frozen (requires_grad=False) parameters this optimizer still holds, and theirs.
    frozen_ids: list[int] = field(default_factory=list)
    frozen: list[torch.Tensor] = field(default_factory=list)
    frozen_fp: Optional[Fingerprint] = None
    pieces: Optional[list[torch.Tensor]] = None
    """Sharded only: the views of this rank's shards that ``fingerprint`` was taken of."""
    frozen_pieces: Optional[list[torch.Tensor]] = None
    """Sharded only: the same for the frozen parameters (``frozen_fp``)."""
    flat_spans: Optional[dict[int, tuple[int, int]]] = None
    """FSDP1 flattened: each original parameter's slice of its flat shard (``fsdp1_flat``)."""
    sharded: Optional[str] = None
    """The sharding engine (``gradwatch.distributed.sharded``): statistics on local shards."""

    def set_params(self, ids: list[int], params: list[torch.Tensor], layer_of: list[str]) -> None:
        self.ids, self.params = ids, params
        self.positions = list(range(len(ids)))
        self.layer_of = list(layer_of)
        self.layer_positions = {}
        for k, layer in enumerate(layer_of):
            self.layer_positions.setdefault(layer, []).append(k)

    def set_frozen(self, held: list[tuple[int, torch.Tensor]]) -> None:
        self.frozen_ids = [i for i, _ in held]
        self.frozen = [p for _, p in held]


@dataclass
class Gathered:
    """Host-side results of one step, aligned with ``Track.ids`` positions ``ks``."""

    ks: list[int]
    ids: list[int]
    arrived: list[bool]
    has_grad: list[bool]
    grad_norm: list[Optional[float]]
    nonfinite: list[bool]
    order: list[int]
    dirty: list[bool]
    cleared: list[bool]
    stats: Optional[dict[str, list[Optional[float]]]]
    scale: Optional[float]
    grads: list[Optional[torch.Tensor]]
    extra: list[float] = field(default_factory=list)
    frozen_changed: list[int] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    """Positions with a non-zero ``.grad`` no backward pass made (``core/steps.py`` fills it)."""
    assigned: bool = False
    """Some ``.grad`` without an arrival is a tensor the last step did not leave."""
    shard: Optional[list[float]] = None
    """Sharded: this rank's shard values for the cross-rank combine (``distributed/sharded.py``)."""
    shard_frozen: list[int] = field(default_factory=list)
    """Sharded: the frozen parameters whose changed flags end ``shard`` (ORed across ranks)."""
    folded: Optional[list[float]] = None
    """Observed, every position live and measured: the per-layer columns of
    ``Track.layer_positions`` (:mod:`gradwatch.measure.columns`)."""
