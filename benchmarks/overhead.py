"""gradwatch's per-step overhead against its peers, and the performance budget it must meet.

Usage::

    .venv/bin/python benchmarks/overhead.py            # full run, both models (minutes)
    .venv/bin/python benchmarks/overhead.py --quick    # short run of model (a): a smoke test
    .venv/bin/python benchmarks/overhead.py --memory   # state growth over 10,000 steps of (a)
    .venv/bin/python benchmarks/overhead.py --quick --check  # ratios vs results.json (CI)

Every variant runs on the same model and optimizer (separate copies differ by several
percent in step time on their own: memory placement), interleaved block by block (A B C ...
then B C ... A, rotating). A block installs the variant's instrumentation (untimed), runs
``settle`` untimed steps for gradwatch variants (past the config's scan window, 20 steps by
default: ``_variants.scan_horizon``; the steady state is what a long run pays, and the scan
steps have their own figures in ``breakdown.py``), times ``--block`` consecutive steps
(default: gradwatch's default ``every_n_steps``, so every gradwatch block holds exactly one
statistics step and the figure is the amortised cost), then removes the instrumentation. The
step time of a variant is the median over its blocks; its added time is that median minus
the baseline's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _check import COMMITTED, compare
from _models import MODELS, ModelCase
from _variants import AB_VARIANTS, VARIANTS, make_variants

import gradwatch

__all__ = ["machine", "main", "run_memory", "run_model"]

DEFAULT_EVERY = gradwatch.GradWatchConfig().every_n_steps


def machine() -> dict[str, Any]:
    """Where the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gradwatch": gradwatch.__version__,
    }


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def run_model(
    case: ModelCase,
    names: list[str],
    *,
    blocks: int,
    warmup: int,
    block: int,
    clock: str = "wall",
) -> dict[str, Any]:
    """Time every variant on ``case``; return the per-variant figures and the budget lines.

    ``clock="cpu"`` times with the process's CPU time (``time.process_time``): with one torch
    thread that is the work done, far less disturbed by other processes on a shared machine
    than wall time (which also counts the time the process waited for a core).
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    ((model, opt),) = case.instances(1)
    batches = case.batches()
    variants = make_variants(names, model, opt, case.loss)
    samples: dict[str, list[float]] = {n: [] for n in names}
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    steps = 0
    for r in range(warmup + blocks):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            v.open()
            try:
                for s in range(v.settle):
                    x, y = batches[(steps + s) % len(batches)]
                    v.step(x, y)
                t0 = now()
                for s in range(block):
                    x, y = batches[(steps + s) % len(batches)]
                    v.step(x, y)
                dt = (now() - t0) / block
            finally:
                v.close()
            if r >= warmup:
                samples[v.name].append(dt * 1e3)
        steps += block
    out: dict[str, Any] = {
        "title": case.title,
        "param_tensors": n_params,
        "clock": clock,
        "variants": {},
    }
    base = statistics.median(samples["baseline"])
    for name in names:
        p25, med, p75 = _quantiles(samples[name])
        out["variants"][name] = {
            "description": VARIANTS[name],
            "ms_per_step": med,
            "p25_ms": p25,
            "p75_ms": p75,
            "added_ms": med - base,
            # the median of each round's difference from that round's baseline block: a slow
            # spell that falls on one round weighs on both sides of its difference alike
            "paired_added_ms": statistics.median(
                v - b for v, b in zip(samples[name], samples["baseline"])
            ),
            "samples": len(samples[name]),
        }
    rows = out["variants"]
    for row in rows.values():
        for ref, key in (("clip_grad_norm", "x_clip"), ("lightning_grad_norm", "x_lightning")):
            ref_row = rows.get(ref, {})
            for added, ratio in (("added_ms", key), ("paired_added_ms", f"paired_{key}")):
                ref_added = ref_row.get(added)
                row[ratio] = row[added] / ref_added if ref_added and ref_added > 0 else None
    if "noop_hooks" in rows:
        out["us_per_empty_hook"] = rows["noop_hooks"]["added_ms"] * 1e3 / (2 * n_params)
    out["budget"] = budget(case.key, rows)
    return out


def budget(key: str, rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The budget lines (issues 7 and 17) that apply to model ``key``: each with its figure and limit."""
    lines: list[dict[str, Any]] = []

    def line(what: str, value: float | None, limit: float | None, unit: str) -> None:
        ok = value is not None and limit is not None and value <= limit
        lines.append({"line": what, "value": value, "limit": limit, "unit": unit, "met": ok})

    def added(name: str) -> float | None:
        return rows[name]["added_ms"] if name in rows else None

    if key == "a":
        clip = added("clip_grad_norm")
        line(
            "default config added <= 1.0 x clip_grad_norm_ added",
            added("gradwatch_default"),
            clip,
            "ms",
        )
        line(
            "every statistic every step added <= Lightning grad_norm added",
            added("gradwatch_every_step"),
            added("lightning_grad_norm"),
            "ms",
        )
        line(
            "hooks only (ghost + zero_grad bookkeeping) <= 0.2 ms/step",
            added("gradwatch_hooks_only"),
            0.2,
            "ms",
        )
    elif key == "b" and "baseline" in rows:
        base = rows["baseline"]["ms_per_step"]
        d = added("gradwatch_default")
        line(
            "default config added <= 2% of the baseline step",
            None if d is None else 100.0 * d / base,
            2.0,
            "%",
        )
    return lines


def print_table(key: str, res: dict[str, Any]) -> None:
    """The human-readable table of one model."""
    print(f"\n({key}) {res['title']}")
    print(
        f"{'variant':<22} {'ms/step':>9} {'added ms':>9} {'x clip':>7} {'x lightning':>11}"
        f" | {'paired ms':>9} {'x clip':>7} {'x lightning':>11}"
    )

    def ratio(v: Optional[float]) -> str:
        return f"{v:.2f}" if v is not None else "-"

    for name, row in res["variants"].items():
        paired = row.get("paired_added_ms", math.nan)
        print(
            f"{name:<22} {row['ms_per_step']:>9.3f} {row['added_ms']:>+9.3f}"
            f" {ratio(row['x_clip']):>7} {ratio(row['x_lightning']):>11}"
            f" | {paired:>+9.3f} {ratio(row.get('paired_x_clip')):>7}"
            f" {ratio(row.get('paired_x_lightning')):>11}"
        )
    if "us_per_empty_hook" in res:
        print(f"empty Python hook: {res['us_per_empty_hook']:.2f} us each")
    for b in res["budget"]:
        v = "n/a" if b["value"] is None else f"{b['value']:.3f}"
        lim = "n/a" if b["limit"] is None else f"{b['limit']:.3f}"
        print(f"  [{'met ' if b['met'] else 'MISS'}] {b['line']}: {v} {b['unit']} (limit {lim})")


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _gradwatch_bytes(snap: tracemalloc.Snapshot) -> int:
    root = os.path.dirname(gradwatch.__file__)
    flt = [tracemalloc.Filter(True, os.path.join(root, "*"))]
    return sum(s.size for s in snap.filter_traces(flt).statistics("filename"))


def run_memory(steps: int, warmup: int = 200) -> dict[str, Any]:
    """Peak RSS and the growth of gradwatch's own allocations over ``steps`` steps of (a)."""
    case = MODELS["a"]
    ((model, opt),) = case.instances(1)
    batches = case.batches()
    checkpoints: list[dict[str, Any]] = []
    with gradwatch.watch(model, opt) as w:
        for s in range(warmup):
            x, y = batches[s % len(batches)]
            opt.zero_grad(set_to_none=True)
            case.loss(model, x, y).backward()
            opt.step()
        gc.collect()
        tracemalloc.start()
        t0 = time.perf_counter()
        marks = {steps // 4, steps // 2, 3 * steps // 4, steps}
        for s in range(steps + 1):
            if s in marks or s == 0:
                gc.collect()
                snap = tracemalloc.take_snapshot()
                checkpoints.append(
                    {
                        "step": warmup + s,
                        "gradwatch_bytes": _gradwatch_bytes(snap),
                        "traced_bytes": tracemalloc.get_traced_memory()[0],
                        "rss_kib": _rss_kib(),
                        "param_copies_held": sum(
                            t.fingerprint is not None for t in w._pipe.structure.tracks
                        ),
                    }
                )
            if s == steps:
                break
            x, y = batches[s % len(batches)]
            opt.zero_grad(set_to_none=True)
            case.loss(model, x, y).backward()
            opt.step()
        elapsed = time.perf_counter() - t0
        tracemalloc.stop()
        history = sum(len(lt.history) for lt in w._pipe.recorder.tracks.values())
        layers = len(w._pipe.recorder.tracks)
    first, last = checkpoints[0], checkpoints[-1]
    return {
        "model": case.title,
        "warmup_steps": warmup,
        "steps": steps,
        "seconds": elapsed,
        "checkpoints": checkpoints,
        "gradwatch_growth_bytes": last["gradwatch_bytes"] - first["gradwatch_bytes"],
        "rss_growth_kib": last["rss_kib"] - first["rss_kib"],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "history_samples": history,
        "history_bound": layers * gradwatch.GradWatchConfig().history,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run of model (a) (smoke test)")
    ap.add_argument(
        "--models", default=None, help="models to run, e.g. 'ab' (default: ab; --quick: a)"
    )
    ap.add_argument(
        "--variants",
        default=",".join(n for n in VARIANTS if n not in AB_VARIANTS),
        help="comma-separated variant names",
    )
    ap.add_argument("--blocks", type=int, default=None, help="measured blocks per variant")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up blocks per variant")
    ap.add_argument("--block", type=int, default=DEFAULT_EVERY, help="steps per block")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: the process's CPU time (steadier on a shared machine)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--memory", action="store_true", help="measure state growth instead of time")
    ap.add_argument("--memory-steps", type=int, default=10_000, help="steps of the --memory run")
    ap.add_argument(
        "--check",
        nargs="?",
        const=COMMITTED,
        type=Path,
        default=None,
        help="compare the ratios with committed figures (default benchmarks/results.json)",
    )
    ap.add_argument("--tolerance", type=float, default=1.5, help="--check: allowed ratio growth")
    ap.add_argument("--strict", action="store_true", help="--check: exit 1 on a regression")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
    result: dict[str, Any] = {"machine": machine(), "block": args.block}
    if args.memory:
        mem = run_memory(args.memory_steps)
        result["memory"] = mem
        print(json.dumps(mem, indent=2))
    else:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown or "baseline" not in names:
            ap.error(
                f"unknown variant(s) {unknown} (known: {', '.join(VARIANTS)}; baseline is required)"
            )
        models = args.models or ("a" if args.quick else "ab")
        result["models"] = {}
        for key in models:
            if key not in MODELS:
                ap.error(f"unknown model {key!r} (known: {', '.join(MODELS)})")
            case = MODELS[key]
            default_blocks = {"a": 40, "b": 4}[key]
            blocks = args.blocks or (3 if args.quick else default_blocks)
            warmup = (
                args.warmup if args.warmup is not None else (1 if args.quick or key == "b" else 3)
            )
            res = run_model(
                case, names, blocks=blocks, warmup=warmup, block=args.block, clock=args.clock
            )
            result["models"][key] = res
            print_table(key, res)
    print(
        f"\nmachine: {result['machine']['cpu']}, {result['machine']['cores']} cores, torch "
        f"{result['machine']['torch']}, torch threads {result['machine']['torch_num_threads']}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.check is not None and not args.memory:
        lines, ok = compare(result, args.check, args.tolerance)
        print("\n" + "\n".join(lines))
        if args.strict and not ok:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
