"""Severity levels and their order."""

from __future__ import annotations

from typing import Literal

Severity = Literal["info", "warning", "error"]
FailOn = Literal["info", "warning", "error", "never"]

RANK: dict[str, int] = {"info": 0, "warning": 1, "error": 2, "never": 3}


def at_least(severity: str, threshold: str) -> bool:
    """Whether ``severity`` reaches ``threshold`` (``"never"`` is reached by nothing)."""
    return threshold != "never" and RANK[severity] >= RANK[threshold]
