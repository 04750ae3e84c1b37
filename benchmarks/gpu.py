"""gradwatch on CUDA: overhead against clip_grad_norm_, host syncs per step, memory.

Usage (a single self-contained script; prints one JSON summary on stdout)::

    python benchmarks/gpu.py --quick     # < 3 minutes
    python benchmarks/gpu.py             # more blocks, larger tensors

Without CUDA it prints ``{"skipped": "no CUDA device"}`` and exits 0. ``--cpu-dry-run`` runs
every combination below on the CPU with tiny sizes and one block (times only: sync counting
and peak memory need CUDA), so that the script's own code is tested where no GPU is
(``tests/packaging/test_benchmarks_run.py``): a GPU machine's time is too scarce to find its bugs.

For each parameter dtype (fp32, bf16, fp16) and optimizer (AdamW fused, AdamW foreach,
SGD+momentum foreach) and each model (400 small tensors; 16 large tensors):

- **time**: baseline, ``clip_grad_norm_``, gradwatch default, gradwatch every step on the
  same model, interleaved block by block (rotating order), ``torch.cuda.synchronize()``
  around each block; figures are medians of per-block ms/step, added over the baseline and
  as a ratio to clip's added time;
- **host syncs**: ``torch.cuda.set_sync_debug_mode("warn")`` during one observed and one
  unobserved gradwatch step; a warning whose frame is in gradwatch's source counts as
  gradwatch's sync (goal: <= 1 on an observed step, 0 on the others);
- **memory**: ``torch.cuda.max_memory_allocated`` over one observed step, with and without
  gradwatch, as a fraction of the parameter bytes (goal: <= 5 %).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradwatch

PKG = os.path.dirname(os.path.abspath(gradwatch.__file__))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def optimizers() -> dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]]:
    return {
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    }


def model(
    kind: str, dtype: torch.dtype, quick: bool, device: str = "cuda"
) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "small":  # hook-bound: 200 x Linear(16, 16) + Tanh, 400 tensors
        layers: list[nn.Module] = []
        for _ in range(20 if device == "cpu" else 200):
            lin = nn.Linear(16, 16)
            nn.init.orthogonal_(lin.weight)
            layers += [lin, nn.Tanh()]
        m, x = nn.Sequential(*layers), torch.randn(32, 16)
    else:  # 16 large tensors: 8 x Linear(w, w)
        w = 64 if device == "cpu" else 2048 if quick else 8192
        m, x = nn.Sequential(*[nn.Linear(w, w) for _ in range(8)]), torch.randn(16, w)
    return m.to(device, dtype), x.to(device, dtype)


def sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, extra: Any = None) -> None:
    opt.zero_grad(set_to_none=True)
    m(x).float().square().mean().backward()
    if extra is not None:
        extra()
    opt.step()


def time_variants(
    m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, blocks: int
) -> dict[str, Any]:
    params = [p for p in m.parameters()]
    clip = lambda: torch.nn.utils.clip_grad_norm_(params, math.inf)  # noqa: E731
    names = ["baseline", "clip", "gradwatch_default", "gradwatch_every_step"]
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(blocks + 1):
        order = names[r % 4 :] + names[: r % 4]
        for name in order:
            w = None
            if name.startswith("gradwatch"):
                cfg = {"every_n_steps": 1} if name.endswith("every_step") else {}
                w = gradwatch.watch(m, opt, config=cfg).attach()
                for _ in range(10):  # past the hook trim (8 steps): the steady state
                    step(m, opt, x)
            sync(x)
            t0 = time.perf_counter()
            for _ in range(10):
                step(m, opt, x, clip if name == "clip" else None)
            sync(x)
            dt = (time.perf_counter() - t0) / 10 * 1e3
            if w is not None:
                w.close()
            if r > 0:
                samples[name].append(dt)
    med = {n: statistics.median(v) for n, v in samples.items()}
    added = {n: med[n] - med["baseline"] for n in names}
    ref = added["clip"]
    return {
        "ms_per_step": med,
        "added_ms": added,
        "x_clip": {n: (added[n] / ref if ref > 0 else None) for n in names[2:]},
    }


def count_syncs(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, Any]:
    w = gradwatch.watch(m, opt, config={"every_n_steps": 2}).attach()
    for _ in range(10):
        step(m, opt, x)
    out: dict[str, Any] = {}
    for label in ("observed", "unobserved"):  # step 10 is observed (10 % 2 == 0), 11 is not
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(m, opt, x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [r for r in rec if "synchroniz" in str(r.message)]
        mine = [r for r in syncs if str(r.filename).startswith(PKG)]
        out[label] = {
            "gradwatch_syncs": len(mine),
            "all_syncs": len(syncs),
            "where": sorted({f"{os.path.basename(r.filename)}:{r.lineno}" for r in mine}),
        }
    w.close()
    out["met"] = (
        out["observed"]["gradwatch_syncs"] <= 1 and out["unobserved"]["gradwatch_syncs"] == 0
    )
    return out


def peak_memory(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, Any]:
    param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    peaks = {}
    for label in ("baseline", "gradwatch"):
        w = (
            gradwatch.watch(m, opt, config={"every_n_steps": 1}).attach()
            if label == "gradwatch"
            else None
        )
        step(m, opt, x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(m, opt, x)
        torch.cuda.synchronize()
        peaks[label] = torch.cuda.max_memory_allocated()
        if w is not None:
            w.close()
    extra = peaks["gradwatch"] - peaks["baseline"]
    return {
        "param_bytes": param_bytes,
        "extra_bytes": extra,
        "extra_fraction": extra / param_bytes,
        "met": extra <= 0.05 * param_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks, smaller large tensors")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cpu-dry-run", action="store_true", help="every combination, tiny, on CPU")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    device = "cpu" if dry else "cuda"
    if dry:
        torch.set_num_threads(1)  # a smoke run: do not take every core of a CI runner
    warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
    t_start = time.perf_counter()
    blocks = 1 if dry else 3 if args.quick else 8
    runs = []
    dtypes = ["fp32", "bf16"] if args.quick and not dry else list(DTYPES)
    for kind in ("small", "large"):
        for dname in dtypes:
            for oname, make in optimizers().items():
                if args.quick and not dry and kind == "small" and oname != "adamw_fused":
                    continue
                m, x = model(kind, DTYPES[dname], args.quick, device)
                opt = make(list(m.parameters()))
                row: dict[str, Any] = {"model": kind, "dtype": dname, "optimizer": oname}
                try:
                    row["time"] = time_variants(m, opt, x, blocks)
                    if not dry:
                        row["syncs"] = count_syncs(m, opt, x)
                        row["memory"] = peak_memory(m, opt, x)
                except Exception as exc:  # report, keep going: one JSON at the end
                    row["error"] = f"{type(exc).__name__}: {exc}"
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                del m, opt, x
                if not dry:
                    torch.cuda.empty_cache()
    summary = {
        "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - t_start,
        "errors": sum(1 for r in runs if "error" in r),
        "syncs_met": all(r.get("syncs", {}).get("met", False) for r in runs),
        "memory_met": all(
            r.get("memory", {}).get("met", False) for r in runs if r["model"] == "large"
        ),
        "runs": runs,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
