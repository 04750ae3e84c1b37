"""What gradwatch adds to each step of model (a), by the step's place after attaching.

``overhead.py`` attaches afresh for every block, runs ``settle`` untimed steps (20 by
default) and times the next ``--block`` (10). This says whether those steps already pay
what a long run pays, or still carry the first steps' work (the scan window, the reading's
choice of parameters, the first turns). Two copies of model (a) take turns step by step in
one process: one watched, one bare; each attach-detach cycle ("epoch") watches the other
copy, so a copy's place (memory placement, its turn in the order: a few hundred
microseconds, measured) cancels out, and who goes first alternates step by step. Figures
are medians over the epochs of the paired difference, in CPU microseconds
(``time.process_time_ns``)::

    .venv/bin/python benchmarks/since_attach.py            # about a minute
    .venv/bin/python benchmarks/since_attach.py --every    # every statistic every step
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
from _variants import scan_horizon

import gradwatch

_now = time.process_time_ns


def _timed(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> int:
    t = _now()
    opt.zero_grad()
    hook_bound.loss(model, x, y).backward()
    opt.step()
    return _now() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=12, help="attach-detach cycles (even)")
    ap.add_argument("--steps", type=int, default=120, help="steps after each attach")
    ap.add_argument("--every", action="store_true", help="every_n_steps=1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    raw = {"every_n_steps": 1} if args.every else {}
    config = gradwatch.GradWatchConfig.coerce(raw)
    block = gradwatch.GradWatchConfig().every_n_steps  # overhead.py's --block default
    settle = scan_horizon(raw)  # overhead.py's untimed steps after attaching
    copies = hook_bound.instances(2)
    batches = hook_bound.batches()
    added: list[list[int]] = [[] for _ in range(args.steps)]
    for epoch in range(args.epochs):
        watched, bare = copies[epoch % 2], copies[1 - epoch % 2]
        with gradwatch.watch(*watched, config=config):
            for s in range(args.steps):
                x, y = batches[s % len(batches)]
                if s % 2:
                    b = _timed(*bare, x, y)
                    a = _timed(*watched, x, y)
                else:
                    a = _timed(*watched, x, y)
                    b = _timed(*bare, x, y)
                added[s].append(a - b)
    per_step = [statistics.median(v) / 1e3 for v in added]
    print(
        f"model (a), {args.epochs} attaches, added us a step (paired medians), by step after attaching:"
    )
    for lo in range(0, args.steps, block):
        row = per_step[lo : lo + block]
        print(
            f"  steps {lo:3d}-{lo + len(row) - 1:3d}: mean {statistics.fmean(row):8.1f}   "
            + " ".join(f"{v:.0f}" for v in row)
        )
    timed = per_step[settle : settle + block]
    start = args.steps // 2 // block * block  # whole blocks: one statistics step in each
    late = per_step[start : start + (args.steps - start) // block * block] or per_step[start:]
    print(
        f"overhead.py's timed block (steps {settle}-{settle + len(timed) - 1}): "
        f"mean {statistics.fmean(timed):.1f} us; "
        f"steps {start}-{start + len(late) - 1}: mean {statistics.fmean(late):.1f} us"
    )


if __name__ == "__main__":
    main()
