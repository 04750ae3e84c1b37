"""What ``exploding_grad``'s running medians cost a step, with warm and with evicted caches.

Usage::

    .venv/bin/python benchmarks/median_windows.py                  # 200 windows of 256
    .venv/bin/python benchmarks/median_windows.py --layers 50 --history 64

Each observed step pushes one norm into every layer's window (checks/_window.py). Between
two pushes a training step runs its forward and backward, which evict the CPU caches; a
loop of pushes alone keeps them warm and hides what a list of float objects costs once
evicted. Two layouts of the sorted copy are pushed the same values, one step each in turn,
timed by the process's CPU clock: gradwatch's (``array('d')``: the values in one block) and
the list it replaced (a pointer per value to a float object somewhere in memory), optionally
with a pass over a 16 MB tensor between pushes, as a step would. Their results are compared
value for value.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from bisect import bisect_left, insort
from collections import deque
from operator import itemgetter

import torch

from gradwatch.checks._window import MedianWindow, WindowColumns, _run


class ListColumns:
    """The list layout ``WindowColumns`` had: the same steps on ``list`` sorted copies."""

    def __init__(self, k: int, maxlen: int) -> None:
        self.maxlen = maxlen
        self.orders: list[deque[float]] = [deque() for _ in range(k)]
        self.sorted: list[list[float]] = [[] for _ in range(k)]

    def push(self, values: list[float]) -> tuple[list[int], list[float], list[float]]:
        s, k = self.sorted, len(self.sorted)
        n = len(s[0])
        if n:
            mid = n // 2
            hi = list(map(itemgetter(mid), s))
            meds = hi if n % 2 else [0.5 * (a + b) for a, b in zip(map(itemgetter(mid - 1), s), hi)]
            tops = list(map(itemgetter(-1), s))
        else:
            meds = tops = [0.0] * k
        if n >= self.maxlen:
            olds = list(map(deque.popleft, self.orders))
            _run(map(list.pop, s, map(bisect_left, s, olds)))
        _run(map(deque.append, self.orders, values))
        _run(map(insort, s, values))
        return [n] * k, meds, tops


def run(layers: int, history: int, steps: int, evict: bool) -> tuple[float, float]:
    """Median CPU us of one push of every window: (array layout, list layout)."""
    rng = random.Random(0)
    arrays = WindowColumns(list(range(layers)), [MedianWindow(history) for _ in range(layers)])
    lists = ListColumns(layers, history)
    junk = torch.randn(1 << 22)  # 16 MB: more than the private caches
    clock = time.process_time
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(steps):
        values = [rng.lognormvariate(0.0, 1.0) for _ in range(layers)]
        got = []
        for side, cols in enumerate((arrays, lists) if step % 2 else (lists, arrays)):
            if evict:
                junk.mul_(1.0)
            t = clock()
            got.append(cols.push(values))
            if step >= history:  # full windows: the steady state
                times[side if step % 2 else 1 - side].append(clock() - t)
        assert got[0] == got[1], f"the layouts disagree at step {step}"
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--history", type=int, default=256, help="values a window keeps")
    ap.add_argument(
        "--steps", type=int, default=1200, help="pushes, the first --history unmeasured"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.layers} windows of {args.history}, us a push of every window (medians):")
    print(f"{'caches':10} {'array':>8} {'list':>8}")
    for evict in (False, True):
        a, b = run(args.layers, args.history, max(args.steps, args.history + 2), evict)
        print(f"{'evicted' if evict else 'warm':10} {a:8.1f} {b:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
