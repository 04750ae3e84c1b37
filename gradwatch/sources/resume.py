"""``resume_state``: what a faithful resume must restore, recorded by ``Watcher.state_dict``
and compared at the first step after ``load_state_dict`` (``resume_mismatch``). The reading
is the watcher's (:mod:`gradwatch.capture.loop.resume`); this source only says it is wanted."""

from __future__ import annotations

from gradwatch.sources.base import EvidenceSource

__all__ = ["ResumeSource"]


class ResumeSource(EvidenceSource):
    name = "resume"
    serves = frozenset({"resume_state"})
