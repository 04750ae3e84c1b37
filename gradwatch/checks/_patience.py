"""Shared bookkeeping for layer checks that fire after ``patience`` consecutive observed steps."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar, cast

K = TypeVar("K", bound=Hashable)


class Streaks:
    """Consecutive-hit counters per key (only the keys on a streak are held)."""

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}

    def __bool__(self) -> bool:
        """Whether any key is on a streak (none: a step without hits changes nothing)."""
        return bool(self._count)

    def hit(self, key: Hashable, condition: bool) -> int:
        """Update ``key``: +1 when ``condition`` holds, else reset. Return the streak."""
        if condition:
            n = self._count[key] = self._count.get(key, 0) + 1
            return n
        if self._count:
            self._count.pop(key, None)
        return 0

    def advance(self, hits: Iterable[K], judged: Callable[[K], bool]) -> dict[K, int]:
        """+1 for each key of ``hits``; every other key on a streak that ``judged`` says was
        judged this step resets, the rest keep theirs. Returns the hits' streaks.

        The cost follows the hits and the streaks, not every key judged: a check whose
        condition holds for few of 200 layers makes no call per layer.

        Example:
            >>> s = Streaks()
            >>> s.advance(["a", "b"], lambda k: True)
            {'a': 1, 'b': 1}
            >>> s.advance(["a"], lambda k: k != "b")  # b not judged: kept
            {'a': 2}
            >>> s.advance(["a", "b"], lambda k: True)
            {'a': 3, 'b': 2}
        """
        count = cast("dict[K, int]", self._count)
        hit = {key: count.get(key, 0) + 1 for key in hits}
        for key in [k for k in count if k not in hit and judged(k)]:
            del count[key]
        count.update(hit)
        return hit
