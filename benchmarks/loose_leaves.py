"""What the loose-leaf search and the loss flag cost (issues 29 and 30).

During the first ``scan_steps`` steps (default 8) ``unregistered_param`` walks the graph of
each ``loss.backward()`` from its root in Python (``gradwatch/capture/loss/loose.py``), and
``nonfinite_param`` keeps one ``isfinite(loss)`` device flag per backward on every step.
This times, on a ResNet-18 layout and a 12-layer GPT-2 (transformers configs, random
weights, CPU, one thread, process CPU time):

- the walk alone, per backward, against the model's own training step (the ratio is the
  added cost of a scan step, before anything else of gradwatch's);
- the first 8 steps of a watcher with the default config against the same with the
  search and the loss flag off (``loose_tensors: false``, ``nonfinite_param`` off), and
  the step after the scan (the flag alone).

Usage::

    .venv/bin/python benchmarks/loose_leaves.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

import gradwatch
from gradwatch.capture.loss.loose import BackwardRoots

Batch = dict[str, torch.Tensor]


def resnet18() -> tuple[nn.Module, Callable[[int], Batch]]:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=10,
    )
    g = torch.Generator().manual_seed(0)

    def batch(k: int) -> Batch:
        return {
            "pixel_values": torch.randn(4, 3, 64, 64, generator=g),
            "labels": torch.randint(0, 10, (4,), generator=g),
        }

    return ResNetForImageClassification(cfg), batch


def gpt2_12() -> tuple[nn.Module, Callable[[int], Batch]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=1000, n_positions=128)
    g = torch.Generator().manual_seed(0)

    def batch(k: int) -> Batch:
        ids = torch.randint(0, 1000, (2, 64), generator=g)
        return {"input_ids": ids, "labels": ids}

    return GPT2LMHeadModel(cfg), batch


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    opt.zero_grad()
    model(**batch).loss.backward()
    opt.step()


def _cpu_ms(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1e3


def walk_cost(model: nn.Module, batch: Callable[[int], Batch], repeats: int) -> dict[str, float]:
    """The walk of one backward graph alone, and the training step it is added to."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = {id(p) for p in model.parameters()}
    roots = BackwardRoots(lambda p: id(p) in ids, lambda w, e: None, loss=False, scan_steps=1)
    roots.remove()  # timed by hand below, not through Tensor.backward
    walks, steps = [], []
    _step(model, opt, batch(0))
    for k in range(repeats):
        b = batch(k)
        steps.append(_cpu_ms(lambda b=b: _step(model, opt, b)))
        loss = model(**b).loss
        before = roots.walked
        walks.append(_cpu_ms(lambda loss=loss: roots._walk(loss.grad_fn)))
        nodes = roots.walked - before
        loss.backward()
        opt.zero_grad()
    step, walk = statistics.median(steps), statistics.median(walks)
    return {"step_ms": step, "walk_ms": walk, "nodes": nodes, "ratio": walk / step}


def watcher_cost(model: nn.Module, batch: Callable[[int], Batch], repeats: int) -> dict[str, float]:
    """The first 8 steps and the 9th-12th, default vs. search and loss flag off."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    off = {
        "checks": {
            "unregistered_param": {"loose_tensors": False},
            "nonfinite_param": {"enabled": False},
        }
    }
    configs: dict[str, Any] = {"default": {}, "off": off}
    first: dict[str, list[float]] = {n: [] for n in configs}
    later: dict[str, list[float]] = {n: [] for n in configs}
    _step(model, opt, batch(0))
    for r in range(repeats):
        for name in list(configs)[r % 2 :] + list(configs)[: r % 2]:
            with gradwatch.watch(model, opt, config=configs[name]):
                first[name].append(
                    _cpu_ms(lambda: [_step(model, opt, batch(k)) for k in range(8)]) / 8
                )
                later[name].append(
                    _cpu_ms(lambda: [_step(model, opt, batch(k)) for k in range(4)]) / 4
                )
    out: dict[str, float] = {}
    for name in configs:
        out[f"first8_{name}_ms"] = statistics.median(first[name])
        out[f"after_{name}_ms"] = statistics.median(later[name])
    out["first8_ratio"] = out["first8_default_ms"] / out["first8_off_ms"]
    out["after_ratio"] = out["after_default_ms"] / out["after_off_ms"]
    return out


def main(repeats: int = 5) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name, make in (("resnet18", resnet18), ("gpt2_12_layers", gpt2_12)):
        model, batch = make()
        w = walk_cost(model, batch, repeats)
        print(
            f"{name:16s} step {w['step_ms']:8.1f} ms  walk {w['walk_ms']:6.2f} ms "
            f"({int(w['nodes'])} nodes) = {w['ratio'] * 100:.2f} % of a step"
        )
        c = watcher_cost(model, batch, max(2, repeats // 2))
        print(
            f"{'':16s} first 8 steps: default {c['first8_default_ms']:.1f} ms vs off "
            f"{c['first8_off_ms']:.1f} ms ({c['first8_ratio']:.3f} x); after the scan: "
            f"{c['after_default_ms']:.1f} vs {c['after_off_ms']:.1f} ms ({c['after_ratio']:.3f} x)"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
