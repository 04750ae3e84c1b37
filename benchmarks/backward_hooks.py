"""What hooks cost a backward pass on model (a), and what a removed hook still costs.

torch keeps calling a tensor's hook dict from C++ after its last hook is removed (empty),
once per parameter per backward. gradwatch clears a tensor pre-hook dict when it is empty
(``release_pre_hooks``); torch's setter cannot clear a post-accumulate dict, so a parameter
whose post hook came off (a read one, ``capture/grads/step_reading.py``) keeps costing about
as much as a Python no-op hook. A hook on the parameter's ``AccumulateGrad`` node goes with
the node once nothing holds it, but a loop that keeps its last ``loss`` until the next
forward keeps the node too (the new graph finds it alive and reuses it): "node kept" runs
that loop. The last lines split gradwatch's own steady-state step into its phases, with the
arrival hooks it uses (light ones, ``capture/grads/deferred.py``) and with post hooks only.

Each line: a hooked copy and a bare copy of the same model alternate backward passes (or
whole steps) in one process; the figure is the median of the hooked minus the bare one, in
CPU microseconds (``time.process_time_ns``), so the machine's load falls on both alike::

    .venv/bin/python benchmarks/backward_hooks.py            # about two minutes
    .venv/bin/python benchmarks/backward_hooks.py --passes 400
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _models import hook_bound
from breakdown import Timings, _step

import gradwatch

_BATCHES = hook_bound.batches()
_now = time.process_time_ns


def _noop(*args: object) -> None:
    return None


def _hook_all(model: nn.Module, how: str) -> None:
    """Put ``how``'s hook on every parameter of ``model`` (and take it off, for "removed";
    "node kept": on the nodes of the last graph, which the loop still holds)."""
    params = list(model.parameters())
    if how in ("post", "post removed"):
        handles = [p.register_post_accumulate_grad_hook(_noop) for p in params]
    elif how in ("pre", "pre removed", "pre released"):
        handles = [p.register_hook(_noop) for p in params]
    else:  # the AccumulateGrad node's hook, dropped: the node goes unless a graph holds it
        nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]  # type: ignore[union-attr]
        handles = [node.register_hook(_noop) for node in nodes]  # type: ignore[union-attr]
        del nodes
    if how not in ("post", "pre"):  # every other state takes its hooks off
        for h in handles:
            h.remove()
    if how == "pre released":
        for p in params:
            p._backward_hooks = None  # type: ignore[assignment]  # as release_pre_hooks


_LAST_LOSS: dict[int, torch.Tensor] = {}  # per model: the loss a loop keeps until the next one


def _backward(model: nn.Module, i: int, keep: bool = False) -> int:
    x, y = _BATCHES[i % len(_BATCHES)]
    for p in model.parameters():
        p.grad = None
    loss = hook_bound.loss(model, x, y)
    t = _now()
    loss.backward()
    took = _now() - t
    if keep:  # as ``for x, y in data: loss = ...``: the last graph lives through the forward
        _LAST_LOSS[id(model)] = loss
    return took


def _backward_kept(model: nn.Module, i: int) -> int:
    return _backward(model, i, keep=True)


X = TypeVar("X")
R = TypeVar("R")


def _paired(run: Callable[[X, int], R], a: X, b: X, n: int) -> list[list[R]]:
    """Alternate ``run`` on ``a`` and ``b`` (ABBA); per pass, what each returned."""
    out: list[list[R]] = [[], []]
    for i in range(n):
        order = ((0, a), (1, b)) if i % 2 else ((1, b), (0, a))
        for k, x in order:
            out[k].append(run(x, i))
    return out


def _added(pair: list[list[int]]) -> float:
    return (statistics.median(pair[0]) - statistics.median(pair[1])) / 1e3


def hooks(passes: int) -> list[tuple[str, float]]:
    """Backward added per hook state, 400 parameters."""
    rows = []
    states = ("post", "post removed", "pre", "pre removed", "pre released", "node removed")
    for how in (*states, "node kept"):
        (hooked, _), (bare, _) = hook_bound.instances(2)
        run = _backward_kept if how == "node kept" else _backward
        if how == "node kept":
            run(hooked, 0)  # the graph the loop keeps: its nodes get the hooks
        _hook_all(hooked, how)
        _paired(run, hooked, bare, 40)  # warm-up
        rows.append((how, _added(_paired(run, hooked, bare, passes))))
    _LAST_LOSS.clear()
    return rows


def _phases_of(pair: tuple[nn.Module, torch.optim.Optimizer], i: int) -> Timings:
    """One step's seconds by phase (``breakdown.py``'s step timer, one step at a time)."""
    into: Timings = collections.defaultdict(float)
    _step(hook_bound, *pair, _BATCHES[i % len(_BATCHES)], into)
    return into


def phases(steps: int, every_n_steps: int, light: bool = True) -> list[tuple[str, float]]:
    """gradwatch's steady state, step by phase: added CPU us against a bare copy
    (``light=False``: post-accumulate arrival hooks only, ``capture/grads/deferred.py``)."""
    watched, bare = hook_bound.instances(2)
    cfg = gradwatch.GradWatchConfig(every_n_steps=every_n_steps)
    watcher = gradwatch.watch(*watched, config=cfg)
    watcher._hooks.arrival.light = watcher._hooks.arrival.light and light
    with watcher:
        _paired(_phases_of, watched, bare, 150)  # past the first steps and the hook trim
        got = _paired(_phases_of, watched, bare, steps)
    names = {"step": "step (gradwatch's decision)"}
    rows = []
    for key in ("zero_grad", "forward", "backward", "step"):
        a = statistics.median(t[key] for t in got[0])
        b = statistics.median(t[key] for t in got[1])
        rows.append((names.get(key, key), (a - b) * 1e6))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=600, help="paired passes per line")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("backward added, 400 parameters of model (a), us (hooked - bare, medians):")
    for how, us in hooks(args.passes):
        print(f"  {how:14s} {us:8.1f}   {us / 400:5.2f} a parameter")
    for every, light in ((1, True), (10, True), (10, False)):
        kind = "light arrival hooks" if light else "post arrival hooks only"
        print(f"gradwatch, every_n_steps={every}, {kind}, added us by phase (medians):")
        for name, us in phases(args.passes, every, light):
            print(f"  {name:28s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
