"""How gradwatch's per-step cost scales with the number of tensors and of elements.

Usage::

    .venv/bin/python benchmarks/scaling.py                # the table in RESULTS.md (minutes)
    .venv/bin/python benchmarks/scaling.py --quick        # small sizes only

A synthetic model holds ``T`` parameter tensors; its loss is ``1e-6 * sum(p**2)`` so the
step's own work is a few passes over the parameters. Per size, every variant runs on the
same model, interleaved block by block exactly as in ``overhead.py`` (same code: each
block holds one statistics step at the default cadence). Reported: ms/step added over the
baseline and its ratio to ``clip_grad_norm_``'s added time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import ModelCase
from overhead import machine, run_model

import gradwatch

NAMES = ["baseline", "clip_grad_norm", "gradwatch_default", "gradwatch_every_step"]
# (tensors, elements per tensor): the tensor axis at 16 x 16, the element axis at 16 tensors
SIZES = [(100, 256), (400, 256), (1600, 256), (6400, 256), (16, 1 << 15), (16, 1 << 19)]
LARGE = (16, 1 << 23)  # 134M elements (0.5 GiB of fp32 parameters)


class Bag(nn.Module):
    """``count`` square-ish parameter tensors of ``size`` elements."""

    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        rows = 1 << ((size.bit_length() - 1) // 2)
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(rows, size // rows)) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1e-6 * sum(p.square().sum() for p in self.ps)  # type: ignore[return-value]


def case(count: int, size: int) -> ModelCase:
    return ModelCase(
        key=f"{count}x{size}",
        title=f"{count} tensors x {size:,} elements",
        build=lambda: Bag(count, size),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-3),
        batches=lambda: [(torch.zeros(1), torch.zeros(1))],
        loss=lambda m, x, y: m(x),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the two smallest sizes only")
    ap.add_argument("--large", action="store_true", help="add 16 x 8.4M (134M elements)")
    ap.add_argument("--large-only", action="store_true", help="only 16 x 8.4M (134M elements)")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
    sizes = SIZES[:2] if args.quick else SIZES + ([LARGE] if args.large else [])
    if args.large_only:
        sizes = [LARGE]
    rows: list[dict[str, Any]] = []
    print(f"{'tensors':>8} {'elements':>12} {'clip ms':>9} {'default':>15} {'every step':>15}")
    for count, size in sizes:
        t0 = time.perf_counter()
        big = count * size > 50_000_000
        res = run_model(
            case(count, size),
            NAMES,
            blocks=2 if big else args.blocks,
            warmup=0,
            block=10,
            clock=args.clock,
        )
        v = res["variants"]
        row = {
            "tensors": count,
            "elements": count * size,
            "baseline_ms": v["baseline"]["ms_per_step"],
            "clip_added_ms": v["clip_grad_norm"]["added_ms"],
            "default_added_ms": v["gradwatch_default"]["added_ms"],
            "every_step_added_ms": v["gradwatch_every_step"]["added_ms"],
            "default_x_clip": v["gradwatch_default"]["x_clip"],
            "every_step_x_clip": v["gradwatch_every_step"]["x_clip"],
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)

        def fmt(ms: float, x: float | None) -> str:
            return f"{ms:+7.2f} ({x:.2f}x)" if x is not None else f"{ms:+7.2f} (-)"

        print(
            f"{count:>8} {count * size:>12,} {row['clip_added_ms']:>9.2f} "
            f"{fmt(row['default_added_ms'], row['default_x_clip']):>15} "
            f"{fmt(row['every_step_added_ms'], row['every_step_x_clip']):>15}",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
