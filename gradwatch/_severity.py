"""Severity levels and their order."""

from __future__ import annotations

from typing import Literal

Severity = Literal["info", "warning", "error"]
FailOn = Literal["info", "warning", "error", "never"]
#: A check's lifecycle stage, as ruff's and clippy's rules: ``stable`` findings carry their
#: severity; ``preview`` ones are ``info`` unless the config sets ``preview: true``.
Maturity = Literal["stable", "preview"]

RANK: dict[str, int] = {"info": 0, "warning": 1, "error": 2, "never": 3}


def at_least(severity: str, threshold: str) -> bool:
    """Whether ``severity`` reaches ``threshold`` (``"never"`` is reached by nothing)."""
    return threshold != "never" and RANK[severity] >= RANK[threshold]
