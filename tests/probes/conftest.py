"""Probe tests run tiny models on one thread (see ``_threads``), and every finding they
produce keeps SPEC 8.1's naming contract (``_named``)."""

from __future__ import annotations

from _named import named_findings
from _threads import one_thread

__all__ = ["named_findings", "one_thread"]
