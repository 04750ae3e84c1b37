"""What the loss-free probes inside ``watch()`` cost (issues 48 and 49): once, as steps.

The same two layouts as ``probes.py`` (ResNet-18's, 11.2 M parameters, 8 x 3 x 32 x 32;
GPT-2's, 12 layers of d=768, 124 M parameters, 4 x 64 tokens; ``--quick``: 2 layers of
d=256), trained by a plain loop under ``gradwatch.watch(model, opt)`` with the default
config (``probes: auto``) and with ``probes: off``, interleaved. Printed per layout:

- one steady training step under watch() with the probes off (the median of the later
  steps), the unit of every ratio;
- the probes' own seconds (their report records, the sum) and the budget they were given
  (10 times the first step, each probe at most its ``budget_s``);
- the first step's wall time with and without them: the one wait the user sees;
- the steady step after them, against the same step with them off (nothing is left behind);
- the bytes of the largest copy a probe made, against the weights'.

Machine speed cancels out of the ratios; on a shared machine read the medians of ``--repeats``.

    .venv/bin/python benchmarks/auto_probes.py [--quick] [--repeats N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
from probes import _cases
from torch import nn

import gradwatch

STEPS = 5


def _loop(model: nn.Module, batch: Any, loss_fn: Any, probes: str) -> tuple[list[float], Any]:
    """``STEPS`` steps of a plain loop under watch(); each step's wall time and the report."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every repeat sees one model
    times = []
    with gradwatch.watch(model, opt, config={"probes": probes, "warn": False}) as w:
        for _ in range(STEPS):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            opt.step()  # the first one waits for the probes
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return times, w.report()


def _layout(model: nn.Module, batch: Any, loss_fn: Any, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[list[float]]] = {"auto": [], "off": []}
    report = None
    _loop(model, batch, loss_fn, "off")  # warm-up: allocator, kernels
    for r in range(repeats):
        for probes in ("auto", "off")[r % 2 :] + ("auto", "off")[: r % 2]:
            times, rep = _loop(model, batch, loss_fn, probes)
            runs[probes].append(times)
            if probes == "auto":
                report = rep
    assert report is not None
    step = statistics.median(t for ts in runs["off"] for t in ts[1:])
    first_auto = statistics.median(ts[0] for ts in runs["auto"])
    first_off = statistics.median(ts[0] for ts in runs["off"])
    later_auto = statistics.median(t for ts in runs["auto"] for t in ts[1:])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    probes = {
        p.id: {
            "verdict": p.verdict,
            "seconds": p.seconds,
            "steps": p.seconds / step,
            "sampled": p.sampled,
            "copy_x_weights": p.memory_bytes / weights,
        }
        for p in report.probes
    }
    budget = report.probes[0].details.get("budget_s") if report.probes else None
    seconds = sum(p.seconds for p in report.probes)
    return {
        "step_s": step,
        "probes_s": seconds,
        "probes_steps": seconds / step,
        "budget_s": budget,
        "first_step_wait_steps": (first_auto - first_off) / step,
        "later_step_ratio": later_auto / step,
        "probes": probes,
        "skipped": [f.message for f in report.findings if f.check == "not_observed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT-2 layout")
    parser.add_argument("--only", choices=["resnet18", "gpt2"], help="one layout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args()
    rows: dict[str, Any] = {"torch": torch.__version__, "machine": platform.processor()}
    for key, (what, model, batch, loss_fn) in _cases(args.quick).items():
        if args.only and key != args.only:
            continue
        row = _layout(model, batch, loss_fn, args.repeats)
        print(
            f"{key}: {what}; steady step {row['step_s']:.3f} s; probes {row['probes_s']:.2f} s "
            f"= {row['probes_steps']:.1f} steps (budget {row['budget_s']} s); first step waits "
            f"{row['first_step_wait_steps']:.1f} steps; later steps x{row['later_step_ratio']:.2f}"
        )
        for pid, p in row["probes"].items():
            print(
                f"  {pid:<18} {p['verdict']:<12} {p['seconds']:6.2f} s = {p['steps']:5.1f} "
                f"steps, copy {p['copy_x_weights']:.1f} x weights"
                + (", sampled" if p["sampled"] else "")
            )
        for line in row["skipped"]:
            print("  not run:", line)
        rows[key] = row
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
