"""``replica_checksums``: a checksum of every replica's parameters rides on the step's one
collective under torch.distributed (``replica_divergence``)."""

from __future__ import annotations

from typing import Any

from gradwatch.distributed.replicas import ReplicaCheck
from gradwatch.sources.base import EvidenceSource, SourceContext

__all__ = ["ReplicaSource"]


class ReplicaSource(EvidenceSource):
    name = "replicas"
    serves = frozenset({"replica_checksums"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        if ctx.dist is not None:
            ctx.dist.replicas = ReplicaCheck(ctx.structure.index, ctx.record)
