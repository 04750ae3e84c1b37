"""Check tests: every finding they produce keeps SPEC 8.1's naming contract (``_named``)."""

from __future__ import annotations

from _named import named_findings

__all__ = ["named_findings"]
