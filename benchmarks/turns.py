"""What the read parameters' turns cost at the steady state of model (a), by their pace.

The step reads most parameters' arrivals (``capture/grads/step_reading.py``) and hooks
``ROTATE`` of them in turn for one window, to compare hook and reading. A turn registers a
light hook on each, fires it and releases it. Three copies of model (a) take turns step by
step in one process: one watched with turns every step (``PACE = 1``, the tenth session's
code), one with the shipped ``PACE``, and a bare one; halfway the two watched copies swap
paces. The figures are paired medians in CPU microseconds (``time.process_time_ns``), so
the machine's load falls on all three alike, averaged over the two halves::

    .venv/bin/python benchmarks/turns.py               # about two minutes
    .venv/bin/python benchmarks/turns.py --steps 3000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _models import hook_bound

import gradwatch
from gradwatch.capture.grads import step_reading

_now = time.process_time_ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="measured steps per copy")
    ap.add_argument("--warm", type=int, default=300, help="steps before the measured ones")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shipped = step_reading.PACE
    copies = hook_bound.instances(3)
    watchers = [gradwatch.watch(m, o) for m, o in copies[:2]]  # copies[2] stays bare
    for w in watchers:
        w.__enter__()
    batches = hook_bound.batches()
    # Two halves: copy 0 paces 1 and copy 1 the shipped pace, then the other way round, so
    # what a copy's place costs (memory placement: a few hundred us, measured) cancels out.
    halves = ([1, shipped], [shipped, 1])
    took: list[dict[int, list[int]]] = [{1: [], shipped: [], 0: []} for _ in halves]
    s = 0
    try:
        for half, paces in zip(took, halves):
            for k in range(args.warm + args.steps):
                x, y = batches[s % len(batches)]
                s += 1
                order = [0, 1, 2] if s % 2 else [2, 1, 0]  # who goes first alternates
                for c in order:
                    model, opt = copies[c]
                    pace = paces[c] if c < 2 else 0
                    step_reading.PACE = pace or shipped  # read at the step's decision
                    t = _now()
                    opt.zero_grad()
                    hook_bound.loss(model, x, y).backward()
                    opt.step()
                    if k >= args.warm:
                        half[pace].append(_now() - t)
    finally:
        step_reading.PACE = shipped
        for w in watchers:
            w.__exit__(None, None, None)

    def paired(half: dict[int, list[int]], a: int, b: int) -> float:
        return statistics.median(x - y for x, y in zip(half[a], half[b])) / 1e3

    print(f"model (a), {args.steps} steps a copy in each half, paired medians, us a step:")
    for name, a, b in (
        ("turns every step (PACE 1), added over bare", 1, 0),
        (f"turns every {shipped} steps (PACE {shipped}), added over bare", shipped, 0),
        (f"PACE {shipped} minus PACE 1", shipped, 1),
    ):
        both = [paired(half, a, b) for half in took]
        print(f"  {name:<48} {sum(both) / 2:8.1f}   (halves {both[0]:.1f}, {both[1]:.1f})")


if __name__ == "__main__":
    main()
