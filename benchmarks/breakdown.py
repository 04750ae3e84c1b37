"""Where gradwatch's added time goes, per phase, per part of the step, per check and source.

Usage::

    .venv/bin/python benchmarks/breakdown.py                   # model (a), default config
    .venv/bin/python benchmarks/breakdown.py --model large     # 8 x Linear(2048, 2048)
    .venv/bin/python benchmarks/breakdown.py --every           # every statistic every step
    .venv/bin/python benchmarks/breakdown.py --steps 300 --warm 300 --gc-steps 1500

One watcher is attached once, as in a user's run, to one of three identical (model,
optimizer) copies; one is the baseline, one calls ``clip_grad_norm_`` after each backward (the
reference). All train in lockstep on the same batches, one step
each in turn, timed by the process's CPU clock (one torch thread). Two windows are measured:
the scan steps (the first 16, where the sources that read once do their work) and the steady
state (after ``--warm`` steps). The garbage collector is off while the parts are timed (its
collections land in whichever line allocates the 700th object); its own share is measured
separately, over ``--gc-steps`` steps with it on, against the baseline copy's.

Lines: the phases of a step (zero_grad, forward, backward, step) watched minus baseline; the
watched copy's place (its time minus the baseline's while both were bare, before attaching:
memory placement and its turn in the step's order, inside every "added" figure); the
parts of gradwatch's step decision (timed by wrappers around them, which add ~0.3 us a call);
then every check's ``on_step`` and every source method above 1 us a step.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import MODELS, ModelCase, large_tensors

import gradwatch
from gradwatch.checks import ALL_CHECKS
from gradwatch.sources.registry import ALL_SOURCES

PARTS = [  # (module, qualified name): the parts of one step's decision
    ("gradwatch.core.steps", "StepPipeline.decide"),
    ("gradwatch.core.steps", "StepPipeline.before_step"),
    ("gradwatch.capture.grads.step_reading", "StepReading.before_gather"),
    ("gradwatch.core.steps", "gather"),
    ("gradwatch.capture.grads.evidence", "Tracker.snapshot"),
    ("gradwatch.core.steps", "_step_view"),
    ("gradwatch.core.findings", "Judges.step"),
    ("gradwatch.sources.sourceset", "SourceSet.device_values"),
    ("gradwatch.sources.sourceset", "SourceSet.read"),
    ("gradwatch.sources.sourceset", "SourceSet.window"),
    ("gradwatch.sources.sourceset", "SourceSet.window_closed"),
    ("gradwatch.sources.sourceset", "SourceSet.after_step"),
]
SOURCE_METHODS = ("install", "device_values", "read", "window", "record", "window_closed")
Timings = dict[str, float]


def _wrap(owner: Any, name: str, key: str, acc: Timings) -> None:
    fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if fn is None:
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(owner, name, timed)


def instrument(acc: Timings) -> None:
    """Wrap the parts, every check's ``on_step`` and every source's methods."""
    for module, qual in PARTS:
        owner: Any = importlib.import_module(module)
        *path, name = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        _wrap(owner, name, qual, acc)
    for check in ALL_CHECKS:
        _wrap(check, "on_step", f"check {check.id}", acc)
    for source in ALL_SOURCES:
        for name in SOURCE_METHODS:
            _wrap(source, name, f"source {source.__name__}.{name}", acc)


def _step(
    case: ModelCase, model: nn.Module, opt: Any, batch: Any, into: Timings, clip: bool = False
) -> None:
    clock = time.process_time
    x, y = batch
    t0 = clock()
    opt.zero_grad(set_to_none=True)
    t1 = clock()
    loss = case.loss(model, x, y)
    t2 = clock()
    loss.backward()
    t3 = clock()
    if clip:  # the reference's copy (an infinite max_norm scales by 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    opt.step()
    t4 = clock()
    for key, dt in zip(
        ("zero_grad", "forward", "backward", "step"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
    ):
        into[key] += dt


def window(
    case: ModelCase, pairs: list[Any], steps: int, start: int, acc: Timings
) -> dict[str, Any]:
    """``steps`` lockstep steps; per-step ms of each phase (both copies) and of each part."""
    batches = case.batches()
    base: Timings = collections.defaultdict(float)
    clipped: Timings = collections.defaultdict(float)
    watched: Timings = collections.defaultdict(float)
    for i in range(start, start + steps):
        batch = batches[i % len(batches)]
        _step(case, *pairs[0], batch, base)
        _step(case, *pairs[2], batch, clipped, clip=True)
        if i == start:
            acc.clear()  # from the first watched step of the window on
        _step(case, *pairs[1], batch, watched)
    per = 1e3 / steps
    return {
        "clip": (sum(clipped.values()) - sum(base.values())) * per,
        "phases": {k: (base[k] * per, watched[k] * per) for k in base},
        "parts": {k: v * per for k, v in sorted(acc.items(), key=lambda kv: -kv[1])},
    }


def gc_share(case: ModelCase, pairs: list[Any], steps: int, start: int) -> tuple[float, float]:
    """Per-step ms of the collector's work in each copy's steps, with it on."""
    spent = [0.0, 0.0]
    side = [0]
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            spent[side[0]] += time.perf_counter() - began[0]

    batches = case.batches()
    gc.callbacks.append(on_gc)
    try:
        for i in range(start, start + steps):
            for k in (0, 1):
                side[0] = k
                _step(case, *pairs[k], batches[i % len(batches)], collections.defaultdict(float))
    finally:
        gc.callbacks.remove(on_gc)
    return spent[0] * 1e3 / steps, spent[1] * 1e3 / steps


def report(title: str, res: dict[str, Any], floor_ms: float) -> None:
    print(f"\n### {title}\n\n| phase | baseline ms | watched ms | added ms |\n|---|---:|---:|---:|")
    total = 0.0
    for k, (b, w) in res["phases"].items():
        total += w - b
        print(f"| {k} | {b:.3f} | {w:.3f} | {w - b:+.3f} |")
    clip = res["clip"]
    print(f"| **all** | | | **{total:+.3f}** = {total / clip:.2f} x clip |")
    print(f"| `clip_grad_norm_` every step (a third copy), added | | | {clip:+.3f} |")
    print("\n| part | ms a step |\n|---|---:|")
    for k, v in res["parts"].items():
        if v >= floor_ms:
            print(f"| {k} | {v:.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="a", choices=[*MODELS, "large"])
    ap.add_argument("--every", action="store_true", help="every_n_steps=1")
    ap.add_argument("--warm", type=int, default=300, help="steps before the steady window")
    ap.add_argument("--steps", type=int, default=300, help="steps in the steady window")
    ap.add_argument("--gc-steps", type=int, default=1000, help="steps of the GC-share line")
    ap.add_argument("--floor", type=float, default=0.005, help="ms a step below which parts hide")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    case = large_tensors if args.model == "large" else MODELS[args.model]
    pairs = case.instances(3)
    acc: Timings = collections.defaultdict(float)
    instrument(acc)
    config = {"every_n_steps": 1} if args.every else {}
    # Before attaching: the watched copy bare too. What it then adds over the baseline is
    # its place alone (memory placement, its turn in the step's order), inside every
    # "added" figure below.
    gc.disable()
    try:
        window(case, pairs, 50, 0, acc)
        bare = window(case, pairs, args.steps, 50, acc)
    finally:
        gc.enable()
    place = sum(w - b for b, w in bare["phases"].values())
    with gradwatch.watch(*pairs[1], config=config):
        gc.disable()
        try:
            scan = window(case, pairs, 16, 0, acc)
            window(case, pairs, max(0, args.warm - 16), 16, acc)
            steady = window(case, pairs, args.steps, args.warm, acc)
        finally:
            gc.enable()
        collector = gc_share(case, pairs, args.gc_steps, args.warm + args.steps)
    print(f"# {case.title}; config {config or 'default'}; torch {torch.__version__}")
    report("scan steps (1-16)", scan, args.floor)
    report(f"steady state (steps {args.warm + 1}-{args.warm + args.steps})", steady, args.floor)
    print(
        f"\nplace: the watched copy, bare before attaching, minus the baseline copy: "
        f"{place:+.3f} ms a step (inside every 'added' figure above)"
    )
    print(
        f"\ngarbage collector, {args.gc_steps} steps with it on: baseline copy's steps "
        f"{collector[0]:.3f} ms a step, watched copy's {collector[1]:.3f} ms a step"
    )


if __name__ == "__main__":
    main()
