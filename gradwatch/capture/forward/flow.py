"""Which layers feed a layer: the data flow of the forward, read once from autograd's graph.

During the first window each layer's forward hook walks back from its inputs' ``grad_fn``
to the nearest parameters (``AccumulateGrad`` nodes) and records their layers. A ghost's
finding groups the layers one cut disconnected (``checks/_grouping.py``): two ghost layers
linked by this data flow share one cause, two independent branches do not.

The walk is breadth-first and stops at the first depth that reaches a parameter, or after
:data:`BUDGET` graph nodes: a few nodes per layer (the residual add, the previous layer's
``AddmmBackward``), run once per layer, never again after the first window.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradwatch.model.index import ParamIndex

__all__ = ["BUDGET", "layer_namer", "upstream_layers"]

BUDGET = 64  # graph nodes visited per layer at most


def _grad_fns(args: Any) -> list[Any]:
    nodes = []
    for a in args if isinstance(args, (tuple, list)) else (args,):
        if isinstance(a, torch.Tensor) and a.grad_fn is not None:
            nodes.append(a.grad_fn)
        elif isinstance(a, (tuple, list)):  # one level of nesting (a tuple of tensors)
            nodes.extend(x.grad_fn for x in a if isinstance(x, torch.Tensor) and x.grad_fn)
    return nodes


def upstream_layers(
    args: Any, layer_of: Callable[[torch.Tensor], Optional[str]], own: str
) -> frozenset[str]:
    """The layers whose parameters are nearest upstream of ``args`` in autograd's graph.

    ``layer_of(tensor)`` names a watched parameter's layer (``None``: not one). ``own``
    (the layer whose inputs these are) is left out. Empty when the inputs carry no graph:
    data, or a tensor detached from what made it.
    """
    frontier = _grad_fns(args)
    seen: set[int] = set()
    found: set[str] = set()
    visited = 0
    while frontier and visited < BUDGET:
        nxt: list[Any] = []
        for node in frontier:
            if id(node) in seen:
                continue
            seen.add(id(node))
            visited += 1
            var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
            if isinstance(var, torch.Tensor):
                layer = layer_of(var)
                if layer is not None and layer != own:
                    found.add(layer)
                continue
            nxt.extend(f for f, _ in node.next_functions if f is not None)
        if found:
            break
        frontier = nxt
    return frozenset(found)


def layer_namer(index: ParamIndex) -> Callable[[torch.Tensor], Optional[str]]:
    """``tensor -> its layer`` for the watched parameters of ``index`` (``None``: not one)."""

    def layer_of(t: torch.Tensor) -> Optional[str]:
        i = index.lookup(t)
        return index.params[i].layer if i is not None else None

    return layer_of
