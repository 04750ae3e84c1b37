"""Per-parameter lists read a slice at a time, and event runs counted from the newest.

The tracker's and the index's lists are indexed by parameter id, and a track's ids are
usually one run (``lo, lo + 1, ..., hi - 1``: one optimizer's parameters, registered in
order). Then a step's reads of them are slices, not comprehensions over 400 ids.
(Writes stay loops: CPython's specialised list stores beat ``map`` passes into a slice,
and a tensor's properties cost the same from either.)
"""

from __future__ import annotations

from collections import deque
from typing import Optional, TypeVar

__all__ = ["count_after", "pick", "span"]

T = TypeVar("T")

_last: list[object] = [None, None]  # (the list last asked about, its answer): one entry


def span(ids: list[int]) -> Optional[slice]:
    """``slice(lo, hi)`` when ``ids`` is ``[lo, lo + 1, ..., hi - 1]``, else None.

    Answers for a list object are cached (a track's ids are one list, asked every step);
    the list must not be changed in place while asked about.

    Example:
        >>> span([3, 4, 5]), span([3, 5]), span([])
        (slice(3, 6, None), None, None)
    """
    if _last[0] is ids:
        return _last[1]  # type: ignore[return-value]
    found = None
    n = len(ids)
    if n and ids[-1] - ids[0] == n - 1 and ids == list(range(ids[0], ids[0] + n)):
        found = slice(ids[0], ids[0] + n)
    _last[0], _last[1] = ids, found
    return found


def pick(values: list[T], ids: list[int]) -> list[T]:
    """``[values[i] for i in ids]``, a slice where ``ids`` is one run.

    Example:
        >>> pick(list("abcdef"), [1, 2, 3]), pick(list("abcdef"), [4, 0])
        (['b', 'c', 'd'], ['e', 'a'])
    """
    run = span(ids)
    return values[run] if run is not None else [values[i] for i in ids]


def count_after(seqs: deque[int], start: int) -> int:
    """How many of ``seqs`` (event numbers in the order they happened) are after ``start``,
    counted from the newest: a step's window holds one or a few of the 256 kept.

    Example:
        >>> count_after(deque([3, 5, 8, 9]), 5), count_after(deque(), 0)
        (2, 0)
    """
    n = 0
    for seq in reversed(seqs):
        if seq <= start:
            break
        n += 1
    return n
