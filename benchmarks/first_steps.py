"""What gradwatch's first steps cost: every hook on, the unregistered-module scan, the NaN probe.

``overhead.py`` times the steady state (after ``trim_hooks_after``). This times the first 10
steps of a fresh watcher on model (a), interleaved with a baseline, for: the default config,
the default without the second-round checks, and the default without the NaN probe.

Usage::

    .venv/bin/python benchmarks/first_steps.py [REPEATS] [--no-warmup]

``--no-warmup`` observes only the ``every_n_steps`` cadence in the first steps (as before
issue 29, which observes each of the first ``FIRST_OBSERVED`` steps).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import MODELS
from _variants import gradwatch_config

import gradwatch
from gradwatch.checks.autocast_bypassed import AutocastBypassed
from gradwatch.checks.eval_mode import EvalModeTraining
from gradwatch.checks.freeze_flag import FreezeNotApplied
from gradwatch.checks.frozen_stats import FrozenStatsUpdated
from gradwatch.core import steps as _steps

# Issue 29's evidence: the modes read at each training forward, the freezing flags read per
# layout, and the autocast probe's output-dtype hooks during the first 3 steps.
_REGIME = (EvalModeTraining, FrozenStatsUpdated, FreezeNotApplied, AutocastBypassed)

CONFIGS: dict[str, Optional[dict[str, Any]]] = {
    "baseline": None,
    "gradwatch_default": {},
    "gradwatch_without_new": gradwatch_config("gradwatch_without_new"),
    "gradwatch_without_nan_probe": {"checks": {"nonfinite_grad": {"trace_steps": 0}}},
    "gradwatch_without_regime": {"checks": {c.id: {"enabled": False} for c in _REGIME}},
}


def main(repeats: int = 8, steps: int = 10) -> dict[str, float]:
    """Median ms/step of the first ``steps`` steps per config."""
    torch.set_num_threads(1)
    case = MODELS["a"]
    ((model, opt),) = case.instances(1)
    batches = case.batches()

    def run(cfg: Optional[dict[str, Any]]) -> float:
        w = gradwatch.watch(model, opt, config=cfg).attach() if cfg is not None else None
        t = time.perf_counter()
        for k in range(steps):
            x, y = batches[k % len(batches)]
            opt.zero_grad()
            case.loss(model, x, y).backward()
            opt.step()
        dt = (time.perf_counter() - t) / steps * 1e3
        if w is not None:
            w.close()
        return dt

    names = list(CONFIGS)
    times: dict[str, list[float]] = {n: [] for n in names}
    run(None)
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:  # rotating order
            times[n].append(run(CONFIGS[n]))
    out = {n: statistics.median(v) for n, v in times.items()}
    base = out["baseline"]
    for n, v in out.items():
        print(f"{n:28s} {v:8.2f} ms/step  ({v / base:.2f} x baseline)")
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--no-warmup" in sys.argv:  # as before issue 29: only every_n_steps's steps observed
        _steps.FIRST_OBSERVED = 0
    main(int(args[0]) if args else 8)
