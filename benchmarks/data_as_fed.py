"""What the ``data_as_fed`` source costs (issue 47 item 8): its four checks
(``batch_repeated``, ``eval_on_trained_samples``, ``batch_single_class``,
``inputs_unscaled``) on against the same watcher with the four off (so the source is not
built), on its scan steps (1-16, every forward's input read: per-sample prints, one host
read per forward) and after (steps 17-32: one step in 2 or 4 read; later, fewer), process
CPU time, one thread, per step (median over repeats). Models as in
``properties_runtime.py``; ``--layouts``: the ResNet-18 and GPT-2 layouts.

Usage::

    .venv/bin/python benchmarks/data_as_fed.py [REPEATS] [--layouts]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

import torch
from properties_runtime import _cpu_ms, _hf, deep_mlp

import gradwatch

CHECKS = ("batch_repeated", "eval_on_trained_samples", "batch_single_class", "inputs_unscaled")


def cost(model: Any, opt: Any, step: Callable[[int], None], repeats: int) -> dict[str, float]:
    off = {"checks": {c: {"enabled": False} for c in CHECKS}}
    configs: dict[str, Any] = {"on": {}, "off": off}
    first: dict[str, list[float]] = {n: [] for n in configs}
    later: dict[str, list[float]] = {n: [] for n in configs}

    def steps(a: int, b: int) -> None:
        for k in range(a, b):
            step(k)

    step(0)
    for r in range(repeats):
        for name in list(configs)[r % 2 :] + list(configs)[: r % 2]:
            with gradwatch.watch(model, opt, config={**configs[name], "warn": False}):
                first[name].append(_cpu_ms(lambda: steps(0, 16)) / 16)
                later[name].append(_cpu_ms(lambda: steps(16, 32)) / 16)
    out = {
        f"{w}_{n}": statistics.median(d[n])
        for w, d in (("scan", first), ("after", later))
        for n in configs
    }
    out["scan_ratio"] = out["scan_on"] / out["scan_off"]
    out["after_ratio"] = out["after_on"] / out["after_off"]
    return out


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
        c = cost(model, opt, step, repeats)
        print(
            f"{name:20s} data_as_fed scan step {c['scan_on']:7.2f} vs off {c['scan_off']:7.2f} ms "
            f"({c['scan_ratio']:.3f} x); steps 17-32 {c['after_on']:7.2f} vs "
            f"{c['after_off']:7.2f} ms ({c['after_ratio']:.3f} x)"
        )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]) if args else 5, "--layouts" in sys.argv)
