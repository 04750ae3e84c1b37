"""Parameter-vector tools: named flattening, adapters, shards, sketches, int8 export,
one-collective all-reduce, and per-layer curvature (:mod:`gradwatch.vectors.sensitivity`)."""

from __future__ import annotations

from gradwatch.vectors.parammap import ParamEntry, ParamMap, ParamMapError
from gradwatch.vectors.shard import Shard, ShardPiece

__all__ = ["ParamEntry", "ParamMap", "ParamMapError", "Shard", "ShardPiece"]
