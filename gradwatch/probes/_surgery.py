"""Custom ``autograd.Function`` nodes that declare their gradient, told apart by measurement.

A Function whose ``backward`` is a constant multiple ``c`` of ``grad_output`` (a DANN
gradient-reversal layer, ``-lambda * g``; a gradient scale; a pass-through, ``c = 1``) is a
declared gradient surgery: the probe runs its ``backward`` on two random ``grad_output`` s
and finds ``c`` the same for both and for every element, whatever the class is called.
A straight-through estimator (``sign``, ``round``, a quantiser, with any surrogate
``backward``) is told by its forward: its output is locally constant, so the loss's finite
difference equals autograd's derivative with the Function's path cut (its ``grad_output``
zeroed); a wrong ``backward`` of a Function whose forward moves does not pass that test.
The class names never decide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from gradwatch.probes._stopgrad import _upstream_params, walk

__all__ = ["Declared", "cut_grads", "declare", "measure_functions"]

_RESIDUAL = 1e-6  # float64 backward of c * g: c is exact to rounding


@dataclass
class Declared:
    """The custom Functions of the loss's graph, measured."""

    surgery: dict[str, float] = field(default_factory=dict)  # class -> c
    explained_ids: set[int] = field(default_factory=set)  # params upstream of a surgery
    candidates: dict[str, list[Any]] = field(default_factory=dict)  # class -> nodes (cut test)
    upstream_of: dict[int, list[str]] = field(default_factory=dict)  # param id -> classes


def _constant_multiple(node: Any) -> Optional[float]:
    """``c`` when the node's backward returns ``c * grad_output`` for two random ones."""
    metas = getattr(node, "_input_metadata", None)
    if not metas:
        return None
    gen = torch.Generator().manual_seed(31)
    found: list[float] = []
    for _ in range(2):
        try:
            gs = [
                torch.randn(tuple(m.shape), generator=gen, dtype=torch.float64).to(
                    device=m.device, dtype=m.dtype
                )
                for m in metas
            ]
            outs = node.apply(*[g.clone() for g in gs])
        except Exception:  # saved tensors freed, a nested tensor, a backward that asserts
            return None
        for i, r in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            if r is None:
                continue
            g = gs[0] if len(gs) == 1 else (gs[i] if i < len(gs) else None)
            if not isinstance(r, Tensor) or g is None or r.shape != g.shape or r.is_sparse:
                return None
            rd, gd = r.detach().double(), g.double()
            c = float((rd * gd).sum() / (gd * gd).sum().clamp_min(1e-300))
            rest = float((rd - c * gd).norm())
            if not math.isfinite(c) or rest > _RESIDUAL * max(float(rd.norm()), 1e-30):
                return None
            found.append(c)
    if not found or max(abs(c - found[0]) for c in found) > _RESIDUAL * max(1.0, abs(found[0])):
        return None
    return found[0]


def measure_functions(nodes: list[Any], upstream: Any) -> Declared:
    """Classify each custom Function node; ``upstream(node)`` gives its parameter ids."""
    out = Declared()
    for node in nodes:
        cls = getattr(node, "_forward_cls", None)
        if cls is None:
            continue
        ids = upstream(node)
        for k in ids:
            out.upstream_of.setdefault(k, []).append(cls.__name__)
        c = _constant_multiple(node)
        if c is None or abs(c - 1.0) <= _RESIDUAL or cls.__module__.startswith("torch."):
            # a pass-through (c = 1: torch's BackwardHookFunction, or an STE whose forward
            # the cut test tells) or torch's own: its forward decides, measured by the cut
            out.candidates.setdefault(cls.__name__, []).append(node)
        else:
            out.surgery[cls.__name__] = c
            out.explained_ids |= ids
    return out


def declare(loss: Tensor, params: list[Tensor]) -> tuple[Declared, Callable[[str], Any]]:
    """The loss's custom Functions measured, and ``cut(name)``: the gradient with the nodes
    of the unexplained Function class ``name`` cut (``None`` when the backward fails), one
    backward per class, run only when asked. The graph must be retained."""
    declared = measure_functions(walk(loss), _upstream_params)
    memo: dict[str, Any] = {}

    def cut(name: str) -> Any:
        if name not in memo:
            nodes = declared.candidates.get(name)
            memo[name] = cut_grads(loss, params, nodes) if nodes else None
        return memo[name]

    return declared, cut


def cut_grads(loss: Tensor, params: list[Tensor], nodes: list[Any]) -> Optional[list[Any]]:
    """Autograd's gradient with every one of ``nodes`` cut (its ``grad_output`` zeroed)."""

    def zero(grads: Any) -> Any:
        return tuple(None if g is None else torch.zeros_like(g) for g in grads)

    handles = [node.register_prehook(zero) for node in nodes]
    try:
        return list(torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True))
    except Exception:  # a wrapper's backward hooks (Opacus) may refuse a second backward
        return None
    finally:
        for h in handles:
            h.remove()
