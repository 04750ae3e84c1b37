"""What the loss-graph source costs on a scan step (issue 40, SPEC 7 source 2).

During the first ``scan_steps`` steps (default 8) the ``loss_graph`` source notes which module
produced which ``grad_fn`` (one global forward hook) and describes each backward's graph
(``gradwatch/capture/loss/graph_walk.py``: kinds, output shapes, a few saved settings; bounded by
node count). After the scan nothing is installed. This times, on a ResNet-18 layout and a
12-layer GPT-2 (transformers configs, random weights, CPU, one thread, process CPU time):

- the description alone, per backward, against the model's own training step;
- a scan step (steps 1-8) and a step after the scan (9-12) of a watcher with the default
  config against the same with the loss-graph rules off (so the source is not built).

Usage::

    .venv/bin/python benchmarks/loss_graph.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable

import torch
from loose_leaves import Batch, _cpu_ms, _step, gpt2_12, resnet18
from torch import nn

import gradwatch
from gradwatch.capture.loss.graph_walk import describe
from gradwatch.capture.loss.loss_graphs import _SETTINGS_OF, MAX_GRAPH_NODES
from gradwatch.checks.registry import ALL_CHECKS

RULES = [c.id for c in ALL_CHECKS if c.needs & {"loss_graph", "loss_terms"}]


def describe_cost(
    model: nn.Module, batch: Callable[[int], Batch], repeats: int
) -> dict[str, float]:
    """One backward graph described (no module marks), and the training step it is added to."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    walks, steps, nodes = [], [], 0
    _step(model, opt, batch(0))
    for k in range(repeats):
        b = batch(k)
        steps.append(_cpu_ms(lambda b=b: _step(model, opt, b)))
        loss = model(**b).loss

        def walk(loss: torch.Tensor = loss) -> None:
            nonlocal nodes
            g = describe(
                loss.grad_fn, {}, max_nodes=MAX_GRAPH_NODES, window=0, settings_of=_SETTINGS_OF
            )
            nodes = len(g.nodes)

        walks.append(_cpu_ms(walk))
        loss.backward()
        opt.zero_grad()
    step, w = statistics.median(steps), statistics.median(walks)
    return {"step_ms": step, "walk_ms": w, "nodes": nodes, "ratio": w / step}


def watcher_cost(model: nn.Module, batch: Callable[[int], Batch], repeats: int) -> dict[str, float]:
    """Scan steps (1-8) and later steps (9-12): default vs. the loss-graph rules off."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    off = {"checks": {c: {"enabled": False} for c in RULES}}
    configs: dict[str, Any] = {"default": {}, "off": off}
    first: dict[str, list[float]] = {n: [] for n in configs}
    later: dict[str, list[float]] = {n: [] for n in configs}

    def steps(n: int) -> None:
        for k in range(n):
            _step(model, opt, batch(k))

    _step(model, opt, batch(0))
    for r in range(repeats):
        for name in list(configs)[r % 2 :] + list(configs)[: r % 2]:
            with gradwatch.watch(model, opt, config={**configs[name], "warn": False}):
                first[name].append(_cpu_ms(lambda: steps(8)) / 8)
                later[name].append(_cpu_ms(lambda: steps(4)) / 4)
    out: dict[str, float] = {}
    for name in configs:
        out[f"scan_{name}_ms"] = statistics.median(first[name])
        out[f"after_{name}_ms"] = statistics.median(later[name])
    out["scan_ratio"] = out["scan_default_ms"] / out["scan_off_ms"]
    out["after_ratio"] = out["after_default_ms"] / out["after_off_ms"]
    return out


def main(repeats: int = 5) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"loss_graph rules: {', '.join(RULES)}")
    for name, make in (("resnet18", resnet18), ("gpt2_12_layers", gpt2_12)):
        model, batch = make()
        w = describe_cost(model, batch, repeats)
        print(
            f"{name:16s} step {w['step_ms']:8.1f} ms  described {w['walk_ms']:6.2f} ms "
            f"({int(w['nodes'])} nodes) = {w['ratio'] * 100:.2f} % of a step"
        )
        c = watcher_cost(model, batch, max(2, repeats // 2))
        print(
            f"{'':16s} scan step: default {c['scan_default_ms']:.1f} ms vs rules off "
            f"{c['scan_off_ms']:.1f} ms ({c['scan_ratio']:.3f} x); after the scan: "
            f"{c['after_default_ms']:.1f} vs {c['after_off_ms']:.1f} ms ({c['after_ratio']:.3f} x)"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
