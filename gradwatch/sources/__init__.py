"""Evidence sources: one registered unit for each kind of evidence a check can need.

See :mod:`gradwatch.sources.base` for the protocol and :mod:`gradwatch.sources.registry`
for the list; the run loops over them through :class:`SourceSet`.
"""

from __future__ import annotations

from gradwatch.sources.base import EvidenceSource, SourceContext, StepState
from gradwatch.sources.sourceset import SourceSet

__all__ = ["EvidenceSource", "SourceContext", "SourceSet", "StepState"]
