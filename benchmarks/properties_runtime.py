"""What the two runtime properties of issue 47 cost (SPEC 8.2): ``loss_input_out_of_domain``
(source ``loss_domain``) and ``call_without_effect`` (source ``state_calls``).

- ``loss_domain``: on the first ``scan_steps`` steps (default 8) a ``TorchFunctionMode`` is
  pushed from the model's forward to ``backward()``: every torch function the forward and
  the loss call passes through it (one Python call each), and each loss call adds a few
  device reductions and one stack walk. After the scan nothing is pushed.
- ``state_calls``: three ``nn.Module`` methods wrapped (a set lookup per call outside the
  watched model), at each step a read of the optimizer's attributes and the other
  optimizers' group learning rates; once per optimizer, a search for other optimizers
  holding its first parameter (``gc.get_referrers``, timed on its own).

Each is timed as a watcher with the default config against the same config with that
property's check off (so its source is not built), on scan steps (1-8) and after (9-12),
process CPU time, one thread, per step (median over repeats). Models: a small many-layer
MLP (48 blocks of Linear-LayerNorm-GELU, width 64, BCE-with-logits and cross-entropy
losses), and with ``--layouts`` the ResNet-18 and 12-layer GPT-2 layouts of
``loose_leaves.py`` (transformers configs, random weights).

Usage::

    .venv/bin/python benchmarks/properties_runtime.py [REPEATS] [--layouts]
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import gradwatch
from gradwatch.capture.loop.lr_writes import LrWrites
from gradwatch.capture.loss.loss_domain import LossDomain

Step = Callable[[int], None]


class _Deep(nn.Module):
    def __init__(self, blocks: int = 48, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(blocks)
        )
        self.cls = nn.Linear(width, classes)
        self.tags = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.cls(h), self.tags(h)


def _cpu_ms(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def deep_mlp() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    model = _Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step(k: int) -> None:
        x = torch.randn(64, 32, generator=g)
        y, tags = torch.randint(0, 10, (64,), generator=g), torch.rand(64, 4, generator=g)
        opt.zero_grad()
        logits, t = model(x)
        (F.cross_entropy(logits, y) + F.binary_cross_entropy_with_logits(t, tags)).backward()
        opt.step()

    return model, opt, step


def _hf(make: Callable[[], Any]) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer, Step]]:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Step]:
        model, batch = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(k: int) -> None:
            opt.zero_grad()
            model(**batch(k)).loss.backward()
            opt.step()

        return model, opt, step

    return build


def watcher_cost(
    model: nn.Module, opt: Any, step: Step, check: str, repeats: int
) -> dict[str, float]:
    """Scan steps (1-8) and later steps (9-12): default vs. ``check`` off."""
    configs: dict[str, Any] = {"on": {}, "off": {"checks": {check: {"enabled": False}}}}
    first: dict[str, list[float]] = {n: [] for n in configs}
    later: dict[str, list[float]] = {n: [] for n in configs}

    def steps(n: int) -> None:
        for k in range(n):
            step(k)

    step(0)
    for r in range(repeats):
        for name in list(configs)[r % 2 :] + list(configs)[: r % 2]:
            with gradwatch.watch(model, opt, config={**configs[name], "warn": False}):
                first[name].append(_cpu_ms(lambda: steps(8)) / 8)
                later[name].append(_cpu_ms(lambda: steps(4)) / 4)
    out = {
        f"{w}_{n}": statistics.median(d[n])
        for w, d in (("scan", first), ("after", later))
        for n in configs
    }
    out["scan_ratio"] = out["scan_on"] / out["scan_off"]
    out["after_ratio"] = out["after_on"] / out["after_off"]
    return out


def mode_cost(model: nn.Module, step: Step, repeats: int) -> dict[str, float]:
    """A step with the mode pushed from the forward to ``backward()`` (what a scan step
    adds) against the same step without it, alternated in one process (no watcher)."""
    dom = LossDomain(model, lambda where, exc: None, scan_steps=10**9)
    on: list[float] = []
    off: list[float] = []
    step(0)
    try:
        for r in range(repeats * 4):
            armed = r % 2 == 0
            dom.window = 0 if armed else 10**9  # scanning (armed by the forward) or not
            t = _cpu_ms(lambda r=r: step(r))  # type: ignore[misc]
            (on if armed else off).append(t)
            dom.take([v for x in dom.values() for v in x.flatten().tolist()])
    finally:
        dom.remove()
    a, b = statistics.median(on), statistics.median(off)
    return {"on": a, "off": b, "ratio": a / b, "calls": dom.seen_calls}


def search_cost(opt: torch.optim.Optimizer) -> tuple[float, int]:
    """The one-time search for other optimizers over the first parameter (ms, gc objects)."""
    w = LrWrites()
    ms = _cpu_ms(lambda: w.watch(0, opt))
    w.remove()
    return ms, len(gc.get_objects())


def main(repeats: int = 5, layouts: bool = False) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models: list[tuple[str, Callable[[], Any]]] = [("deep_mlp_48_blocks", deep_mlp)]
    if layouts:
        here = sys.path.pop(0)  # benchmarks/kernels.py shadows the `kernels` package
        import transformers.activations  # noqa: F401 (its hub-kernel import, once, first)

        sys.path.insert(0, here)
        from loose_leaves import gpt2_12, resnet18

        models += [("resnet18", _hf(resnet18)), ("gpt2_12_layers", _hf(gpt2_12))]
    for name, make in models:
        model, opt, step = make()
        m = mode_cost(model, step, repeats)
        print(
            f"{name:20s} the loss-domain mode alone: {m['on']:7.2f} vs {m['off']:7.2f} ms per step "
            f"({m['ratio']:.3f} x, {m['calls']} loss calls read)"
        )
        for check in ("loss_input_out_of_domain", "call_without_effect"):
            c = watcher_cost(model, opt, step, check, repeats)
            print(
                f"{name:20s} {check:26s} scan step {c['scan_on']:7.2f} vs off {c['scan_off']:7.2f} ms "
                f"({c['scan_ratio']:.3f} x); after the scan {c['after_on']:7.2f} vs "
                f"{c['after_off']:7.2f} ms ({c['after_ratio']:.3f} x)"
            )
        ms, objects = search_cost(opt)
        print(
            f"{name:20s} other-optimizer search, once per optimizer: {ms:.1f} ms ({objects} gc objects)"
        )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 5, "--layouts" in sys.argv)
