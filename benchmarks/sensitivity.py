"""What a Hessian-vector product costs next to a plain backward pass (``gradwatch.sensitivity``).

Measured in one process, on the same model and batch, interleaved round by round:

* ``backward``: ``loss_fn(model, batch).backward()`` (forward included), per second;
* ``hvp``: ``gradwatch.sensitivity`` with a fixed number of products (``tol=0`` so the
  power iteration never stops early), products per second, the forward and the
  ``create_graph`` gradient amortised over them.

The ratio ``hvp/s ÷ backward/s`` is the figure to read (machine speed cancels out).

    .venv/bin/python benchmarks/sensitivity.py            # both models
    .venv/bin/python benchmarks/sensitivity.py --quick    # small settings, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import TinyLM, hook_bound

import gradwatch
from gradwatch.vectors.sensitivity import layer_groups

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def _cases(quick: bool) -> dict[str, tuple[str, nn.Module, Any, LossFn]]:
    torch.manual_seed(0)
    mlp = hook_bound.build()
    x, y = hook_bound.batches()[0]
    if quick:
        mlp = nn.Sequential(*list(mlp)[:40])  # 20 of the 200 Linear+Tanh blocks
    lm = TinyLM(d=64, heads=4, layers=2, ctx=32).eval()  # no dropout: one graph every call
    tokens = torch.randint(0, 1000, (4, 33), generator=torch.Generator().manual_seed(1))

    def mse(m: nn.Module, b: Any) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    def next_token(m: nn.Module, b: Any) -> torch.Tensor:
        # PyTorch's fused CPU attention has no double backward ("derivative for
        # aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"):
        # the math kernel computes the same attention and differentiates twice.
        with sdpa_kernel(SDPBackend.MATH):
            return nn.functional.cross_entropy(m(b[:, :-1]).reshape(-1, 1000), b[:, 1:].reshape(-1))

    return {
        "a": (f"{len(mlp) // 2} x Linear(16,16)+Tanh, batch 32", mlp, (x, y), mse),
        "lm": ("TransformerEncoder LM d=64, 2 layers, 4 x 32 tokens", lm, tokens, next_token),
    }


def _backward_rate(model: nn.Module, batch: Any, loss_fn: LossFn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
    return reps / (time.perf_counter() - start)


def _hvp_rate(
    model: nn.Module, batch: Any, loss_fn: LossFn, samples: int, iters: int
) -> tuple[float, int]:
    start = time.perf_counter()
    curv = gradwatch.sensitivity(model, batch, loss_fn, samples=samples, power_iters=iters, tol=0.0)
    return curv.hvps / (time.perf_counter() - start), curv.hvps


def run(quick: bool, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    samples, iters, reps = (4, 2, 5) if quick else (8, 4, 20)
    out: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
        },
        "settings": {
            "samples": samples,
            "power_iters": iters,
            "backward_reps": reps,
            "rounds": rounds,
        },
        "models": {},
    }
    for key, (title, model, batch, loss_fn) in _cases(quick).items():
        layers = len(layer_groups(model))
        _backward_rate(model, batch, loss_fn, 1)  # warm-up
        back, hvp, count = [], [], 0
        for _ in range(rounds):  # interleaved: drift in machine load hits both alike
            back.append(_backward_rate(model, batch, loss_fn, reps))
            rate, count = _hvp_rate(model, batch, loss_fn, samples, iters)
            hvp.append(rate)
        b, h = statistics.median(back), statistics.median(hvp)
        out["models"][key] = {
            "title": title,
            "layers": layers,
            "hvps_per_call": count,
            "backward_per_s": b,
            "hvp_per_s": h,
            "ratio": h / b,
        }
        print(
            f"({key}) {title}: {layers} layers, backward {b:.1f}/s, HVP {h:.1f}/s, ratio {h / b:.2f}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small settings (seconds)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    result = run(args.quick, args.rounds)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
