"""pytest plugin for gradwatch (work in progress)."""

from __future__ import annotations

__all__: list[str] = []
