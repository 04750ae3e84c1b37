"""Shared bookkeeping for layer checks that fire after ``patience`` consecutive observed steps."""

from __future__ import annotations

from collections.abc import Hashable


class Streaks:
    """Consecutive-hit counters per key."""

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}

    def hit(self, key: Hashable, condition: bool) -> int:
        """Update ``key``: +1 when ``condition`` holds, else reset. Return the streak."""
        n = self._count.get(key, 0) + 1 if condition else 0
        self._count[key] = n
        return n
