"""gradwatch's extra peak memory on a >=100M-parameter model, one subprocess per mode.

Usage::

    .venv/bin/python benchmarks/memory.py              # 6 x Linear(4096, 4096): 100.7M params
    .venv/bin/python benchmarks/memory.py --width 1024 # a small smoke run
    .venv/bin/python benchmarks/memory.py --alone      # also each loss-free probe alone

Each mode runs in a fresh Python process (peak RSS, ``ru_maxrss``, is per process and never
goes down): the same seeded model, SGD, the same steps. ``baseline`` trains without
gradwatch; ``gradwatch`` watches with every statistic on every step (``every_n_steps=1``:
a fingerprint before and a comparison after every step, the worst case), with the default
``probes: auto``, whose loss-free probes run once after the first step, on copies of the
model whose parameters read its weights (``--alone``: one mode per probe, the others off);
``probes_off`` the same with ``probes: off`` (gradwatch's own steady memory); ``copy`` takes a
full pre-step copy of every parameter, what gradwatch did before (the reference for the
"2x the model" figure). Extra peak = the mode's peak RSS minus the baseline's, as a fraction
of the parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

MODES = ("baseline", "gradwatch", "probes_off", "copy")


def child(mode: str, width: int, layers: int, steps: int) -> dict[str, Any]:
    """Train in this process and report its peak RSS."""
    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import gradwatch  # every mode imports it: the figure is what watching costs

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
    _warm_up(gradwatch, torch, nn)  # every mode: code and import pages are not the model's
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    x = torch.randn(4, width)
    ctx = None
    alone = mode.removeprefix("alone:") if mode.startswith("alone:") else None
    if mode in ("gradwatch", "probes_off") or alone:
        cfg: dict[str, Any] = {"every_n_steps": 1}
        if mode == "probes_off":
            cfg["probes"] = "off"
        if alone:  # one loss-free probe on, the others off
            from gradwatch.probes import LOSS_FREE_PROBES

            cfg["checks"] = {p: {"enabled": p == alone} for p in LOSS_FREE_PROBES}
        ctx = gradwatch.watch(model, opt, config=cfg)
        ctx.__enter__()
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)  # grads stay allocated: steady-state memory
        model(x).square().mean().backward()
        copies = [p.detach().clone() for p in params] if mode == "copy" else None
        opt.step()
        del copies
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # over the steps
    if ctx is not None:
        ctx.__exit__(None, None, None)
        assert ctx.report().layers[0].update_ratio is not None  # it really measured updates
    return {"mode": mode, "params": n, "param_bytes": n * 4, "peak_rss_bytes": peak}


def _warm_up(gradwatch: Any, torch: Any, nn: Any) -> None:
    """A few watched steps of a tiny model and a report: imports, caches, code pages."""
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with gradwatch.watch(m, opt, config={"every_n_steps": 1}) as w:
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(4, 64)).square().mean().backward()
            opt.step()
    w.report()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--alone", action="store_true", help="also each loss-free probe alone (one more mode each)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.width, args.layers, args.steps)))
        return 0
    rows: dict[str, dict[str, Any]] = {}
    modes = list(MODES)
    if args.alone:
        from gradwatch.probes import LOSS_FREE_PROBES

        modes += [f"alone:{p}" for p in LOSS_FREE_PROBES]
    for mode in modes:
        cmd = [sys.executable, __file__, "--child", mode, "--width", str(args.width)]
        cmd += ["--layers", str(args.layers), "--steps", str(args.steps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    base = rows["baseline"]["peak_rss_bytes"]
    pb = rows["baseline"]["param_bytes"]
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}), {rows['baseline']['params']:,} params ({pb / 2**20:.0f} MiB fp32)"
    )
    for mode, r in rows.items():
        r["extra_bytes"] = r["peak_rss_bytes"] - base
        r["extra_fraction_of_params"] = r["extra_bytes"] / pb
        print(
            f"{mode:<10} peak RSS {r['peak_rss_bytes'] / 2**20:8.1f} MiB  extra {r['extra_bytes'] / 2**20:+8.1f} MiB = {100 * r['extra_fraction_of_params']:+6.2f} % of the parameter bytes"
        )
    frac = rows["probes_off"]["extra_fraction_of_params"]
    verdict = "met" if frac <= 0.05 else "MISS"
    print(
        f"[{verdict}] gradwatch's extra peak, probes off, <= 5 % of parameter bytes (goal 1 %): "
        f"{100 * frac:.2f} %"
    )
    probes = rows["gradwatch"]["extra_fraction_of_params"]
    verdict = "met" if probes <= 1.0 else "MISS"
    print(
        f"[{verdict}] with the loss-free probes (once, the first step), <= one copy of the "
        f"weights (issue 49): {100 * probes:.2f} %"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
