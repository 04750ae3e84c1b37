"""The large-tensor line: every statistic every step on 8 x Linear(2048, 2048), against clip.

Usage::

    .venv/bin/python benchmarks/large_line.py                 # two halves, 12 rounds each
    .venv/bin/python benchmarks/large_line.py --checksums     # also: every tensor checksummed

Two copies of the model, A and B, run in one process. In the first half A is watched with
``every_n_steps=1`` while B runs bare and with ``clip_grad_norm_``; in the second half they
swap, so where each copy's memory happens to lie (breakdown.py measured up to 3.7 ms a step
between copies) cancels out of the mean of the halves. Each round runs a few steps of each
variant, in an order that rotates; the figures are medians of CPU time per step (one torch
thread), and each line is gradwatch's added time over clip's.

``--checksums`` adds a variant of the watched copy in which every large tensor takes its
checksum (``measure/carry.py`` judges a tensor whose samples move by its samples alone): the
cost of that integer sum, measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from _models import large_tensors
from torch import nn

import gradwatch
from gradwatch.measure import carry

STEPS = 4  # timed steps per variant and round
WARM = 30  # steps after attaching before the first round (the scan window and caches)


def _stepper(case: Any, model: nn.Module, opt: Any, clip: bool = False) -> Callable[[], None]:
    x, y = case.batches()[0]

    def step() -> None:
        opt.zero_grad()
        case.loss(model, x, y).backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()

    return step


def _half(
    case: Any, watched: tuple[nn.Module, Any], bare: tuple[nn.Module, Any], args: Any
) -> dict[str, float]:
    """Median CPU ms per step of each variant, with ``watched`` under gradwatch."""
    times: dict[str, list[float]] = {"bare": [], "clip": [], "gradwatch": []}
    if args.checksums:
        times["checksummed"] = []
    runs = {
        "bare": _stepper(case, *bare),
        "clip": _stepper(case, *bare, clip=True),
        "gradwatch": _stepper(case, *watched),
    }
    real_still = carry.still
    with gradwatch.watch(watched[0], watched[1], config={"every_n_steps": 1}):
        for _ in range(WARM):
            runs["gradwatch"]()
            runs["bare"]()
        names = list(times)
        try:
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    step = runs.get(name, runs["gradwatch"])
                    if name in ("gradwatch", "checksummed"):
                        on = name == "checksummed"
                        carry.still = (lambda t: True) if on else real_still  # type: ignore[assignment]
                        step()  # a switch of mode settles in one step (a fresh checksum read)
                    for _ in range(STEPS):
                        t = time.process_time()
                        step()
                        times[name].append(time.process_time() - t)
        finally:
            carry.still = real_still  # type: ignore[assignment]
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12, help="rounds per half")
    ap.add_argument("--checksums", action="store_true", help="add the checksummed variant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    case = large_tensors
    pairs = case.instances(2)
    halves = [_half(case, pairs[0], pairs[1], args), _half(case, pairs[1], pairs[0], args)]
    print(f"# {case.title}; torch {torch.__version__}; CPU ms a step, medians")
    print(
        "| half | bare | clip added | "
        + " | ".join(k for k in halves[0] if k not in ("bare", "clip"))
        + " |"
    )
    for h, m in zip(("A watched", "B watched"), halves):
        clip = m["clip"] - m["bare"]
        cells = [
            f"+{m[k] - m['bare']:.2f} = {(m[k] - m['bare']) / clip:.2f} x"
            for k in m
            if k not in ("bare", "clip")
        ]
        print(f"| {h} | {m['bare']:.1f} | +{clip:.2f} | " + " | ".join(cells) + " |")
    clip = statistics.mean(m["clip"] - m["bare"] for m in halves)
    for k in halves[0]:
        if k not in ("bare", "clip"):
            added = statistics.mean(m[k] - m["bare"] for m in halves)
            print(
                f"mean of the halves, {k}: +{added:.2f} ms = {added / clip:.2f} x clip (+{clip:.2f})"
            )


if __name__ == "__main__":
    main()
