"""A bounded window of recent values with its median in O(log n) per update."""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Hashable
from itertools import repeat
from operator import add, itemgetter, mul

__all__ = ["MedianWindow", "WindowColumns"]


class MedianWindow:
    """The last ``maxlen`` values, kept in arrival order and sorted.

    ``exploding_grad`` needs each layer's running median on every observed step; sorting
    the whole window per layer per step cost about 1 ms per 100 layers (measured on the
    hook-bound benchmark). A sorted copy updated by bisection gives the same median.

    The sorted copy is an ``array('d')``, not a list: a training step's forward and backward
    evict the CPU caches between two pushes, and a list's bisection then follows a pointer
    to a scattered float object per comparison. The array's values lie in one block
    (2 KB for 256). 200 windows of 256, a push after a cache-evicting pass: 276-360 -> 190-250
    us; with warm caches, which a training loop never gives them, within 8 % either way
    (``benchmarks/median_windows.py``).

    Example:
        >>> w = MedianWindow(3)
        >>> for v in (5.0, 1.0, 3.0, 9.0):
        ...     w.append(v)
        >>> len(w), w.median()
        (3, 3.0)
    """

    __slots__ = ("_order", "_sorted", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._order: deque[float] = deque()
        self._sorted: array[float] = array("d")

    def __len__(self) -> int:
        return len(self._order)

    def append(self, value: float) -> None:
        """Add ``value``; the oldest value leaves once ``maxlen`` are held."""
        if self.maxlen <= 0:
            return
        if len(self._order) >= self.maxlen:
            old = self._order.popleft()
            del self._sorted[bisect_left(self._sorted, old)]
        self._order.append(value)
        insort(self._sorted, value)

    def push(self, value: float) -> tuple[int, float, float]:
        """(count, median, largest) of the values held, 0.0 for none; then ``value`` joins.

        One call where ``exploding_grad`` made four per layer per step (``len``, ``median``,
        ``quantile(1.0)``, ``append``).

        Example:
            >>> w = MedianWindow(3)
            >>> [w.push(v) for v in (5.0, 1.0, 3.0)]
            [(0, 0.0, 0.0), (1, 5.0, 5.0), (2, 3.0, 5.0)]
        """
        s = self._sorted
        n = len(s)
        if not n:
            self.append(value)
            return (0, 0.0, 0.0)
        mid = n // 2
        found = (n, s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid]), s[-1])
        order = self._order  # append, inline: this runs per layer on every observed step
        if n >= self.maxlen:
            del s[bisect_left(s, order.popleft())]
        order.append(value)
        insort(s, value)
        return found

    def median(self) -> float:
        """The median of the held values (the mean of the middle two for an even count)."""
        s = self._sorted
        mid = len(s) // 2
        return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])

    def quantile(self, q: float) -> float:
        """The held value at fraction ``q`` of the sorted window (nearest rank)."""
        s = self._sorted
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


_HALF = repeat(0.5)


def _run(it: object) -> None:
    """Run a ``map`` for its effects, at C speed."""
    deque(it, maxlen=0)  # type: ignore[call-overload]


class WindowColumns:
    """The windows of one list of keys (a layout's layers), pushed together.

    On every observed step ``exploding_grad`` pushes one value into each layer's window; per
    layer that is a Python call and a few list operations (200 layers: about 0.1 ms a step).
    When every window holds as many values (the usual case: each layer got a value on each
    step), the medians are one ``itemgetter`` pass over the sorted lists and the updates are
    C-level ``map`` passes, with the same results as :meth:`MedianWindow.push` per window:
    the windows are the same objects either way.

    Example:
        >>> cols = WindowColumns(["a", "b"], [MedianWindow(2), MedianWindow(2)])
        >>> [cols.push(v) for v in ([1.0, 4.0], [3.0, 2.0], [5.0, 6.0])][-1]
        ([2, 2], [2.0, 3.0], [3.0, 4.0])
        >>> cols.windows[0].push(0.0)  # the same window, read alone
        (2, 4.0, 5.0)
    """

    __slots__ = ("_orders", "_sorted", "keys", "maxlen", "row", "windows")

    def __init__(self, keys: list[Hashable], windows: list[MedianWindow]) -> None:
        self.keys = keys
        self.windows = windows
        self.row = dict(zip(keys, range(len(keys))))
        self._orders = [w._order for w in windows]
        self._sorted = [w._sorted for w in windows]
        sizes = {w.maxlen for w in windows}
        self.maxlen = sizes.pop() if len(sizes) == 1 else 0  # 0: pushed one by one

    def push(self, values: list[float]) -> tuple[list[int], list[float], list[float]]:
        """Per window, in order: (count, median, largest) before its value joins, as
        :meth:`MedianWindow.push` gives; then each value joins its window."""
        s = self._sorted
        counts = set(map(len, s))
        if len(counts) != 1 or self.maxlen <= 0:
            found = list(map(MedianWindow.push, self.windows, values))
            return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]
        n = counts.pop()
        k = len(s)
        if n:
            mid = n // 2
            hi = list(map(itemgetter(mid), s))
            # 0.5 * (lo + hi), as MedianWindow's, C-level (a product commutes exactly)
            meds = hi if n % 2 else list(map(mul, map(add, map(itemgetter(mid - 1), s), hi), _HALF))
            tops = list(map(itemgetter(-1), s))
        else:
            meds = tops = [0.0] * k
        orders = self._orders
        if n >= self.maxlen:  # the oldest values leave
            olds = list(map(deque.popleft, orders))
            _run(map(array.pop, s, map(bisect_left, s, olds)))
        _run(map(deque.append, orders, values))
        _run(map(insort, s, values))
        return [n] * k, meds, tops
