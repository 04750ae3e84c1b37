"""The directions ``gradient_mismatch`` moves a copy's weights along, held in place.

A :class:`Direction` is a unit random vector through some parameters of the probe's copy,
with their values to come back to. For the joint direction through every layer each list
costs a copy of the (float64) weights, so nothing here makes a second list of the same size:
the vector is drawn, normalised and weighted in place, and temporaries are one tensor at a
time (issue 49's memory budget: on 6 x Linear(4096, 4096) the probes' peak went from 11.8 x
the parameter bytes to 8.0 x, measured with ``benchmarks/memory.py``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["Direction", "even_out"]


class Direction:
    """A direction ``v`` through some parameters and their values ``base`` to come back to.

    Held in place, one tensor of temporaries at a time: for the joint direction through every
    layer, each whole-model list costs a copy of the float64 weights (issue 49's memory
    budget). ``base`` keeps a float64 weight that holds float32 values (a float32 model
    widened for the probe) as float32: exact, and half the bytes.
    """

    def __init__(self, name: str, names: list[str], params: list[Tensor], seed: int) -> None:
        self.name, self.names, self.params = name, names, params
        gen = torch.Generator().manual_seed(seed)
        v = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        norm = math.sqrt(sum(float(torch.dot(r.view(-1), r.view(-1))) for r in v)) or 1.0
        self.v = [r.div_(norm).to(p.device, p.dtype) for r, p in zip(v, params)]
        del v
        self.base = [_narrow(p.detach()) for p in params]
        size = math.sqrt(sum(float(b.double().pow(2).sum()) for b in self.base))
        self.scale = max(1.0, size)

    def exclude(self, masks: Any) -> None:
        """Leave out the rows whose documented gradient is not the derivative (padding)."""
        v = masks.apply(self.params, self.v)
        norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in v))
        if norm > 0.0:
            self.v = [d.div_(norm) for d in v]

    def shift(self, h: float) -> None:
        with torch.no_grad():
            for p, b, v in zip(self.params, self.base, self.v):
                p.copy_(torch.add(b.to(p.dtype), v, alpha=h))

    def directional(self, grads: list[Optional[Tensor]]) -> float:
        return float(sum(float((g * v).sum()) for g, v in zip(grads, self.v) if g is not None))


def even_out(whole: Direction, groups: list[Any], grads: list[Optional[Tensor]]) -> None:
    """Weight each layer's block of the joint direction by 1 / its gradient's norm (at most
    1000 x the smallest weight), so that every layer moves the directional derivative about
    alike: a wrong derivative in an early layer of a deep net, whose gradient is small, is
    not lost in the others'."""
    sizes, flat = [], iter(grads)
    for g in groups:
        sq = sum(
            float(t.double().pow(2).sum()) for t in (next(flat) for _ in g[2]) if t is not None
        )
        sizes.append(math.sqrt(sq))
    top = max(sizes) if sizes else 0.0
    if top <= 0.0:
        return
    weights = [1.0 / max(size, 1e-3 * top) for size, g in zip(sizes, groups) for _ in g[2]]
    for v, w in zip(whole.v, weights):  # in place: whole.v is the layer's own
        v.mul_(w)
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in whole.v)) or 1.0
    for v in whole.v:
        v.div_(norm)


def _narrow(p: Tensor) -> Tensor:
    """A copy of ``p``: float32 where ``p`` is float64 holding float32 values (exactly)."""
    if p.dtype == torch.float64:
        low = p.to(torch.float32)
        if torch.equal(low.to(torch.float64), p):
            return low
    return p.clone()
