"""Added CPU ms/step of gradwatch on model (a), one number (every statistic every step, or
``--every-n-steps 10`` for the default cadence).

For before/after comparisons of two checkouts on a noisy machine: run it alternately from
each checkout (``PYTHONPATH=<checkout> python benchmarks/every_step_added.py``) and compare
the medians. In one process, a bare copy and a watched copy of the same model alternate
``--blocks`` blocks of 20 steps; the result is the median of the blocks' added time.
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


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    batches = _BATCHES
    t = time.process_time()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        hook_bound.loss(model, x, y).backward()
        opt.step()
    return (time.process_time() - t) / steps * 1e3


_BATCHES = hook_bound.batches()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument(
        "--every-n-steps", type=int, default=1, help="the statistics cadence (10: the default)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    (bare, bare_opt), (watched, watched_opt) = hook_bound.instances(2)
    cfg = gradwatch.GradWatchConfig(every_n_steps=args.every_n_steps)
    with gradwatch.watch(watched, watched_opt, config=cfg):
        _run(bare, bare_opt, 20)
        _run(watched, watched_opt, 20)  # past the hook trim: the steady state
        added = [
            -_run(bare, bare_opt, 20) + _run(watched, watched_opt, 20) for _ in range(args.blocks)
        ]
    print(f"{statistics.median(added):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
