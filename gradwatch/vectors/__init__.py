"""Parameter-vector tools: named flattening, int8 export, one-collective all-reduce."""

from __future__ import annotations

from gradwatch.vectors.parammap import ParamEntry, ParamMap, ParamMapError

__all__ = ["ParamEntry", "ParamMap", "ParamMapError"]
