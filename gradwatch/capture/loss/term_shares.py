"""Per-term gradient attribution of a summed loss, on scan steps.

The terms of a loss are its root's ``AddBackward0`` tree (:meth:`GraphDesc.terms`). The
values the terms share (the model's trunk) are the graph nodes reachable from two terms or
more; each edge from a node only one term reaches into a shared one is where that term's
gradient enters the trunk. A hook on each such node (``Node.register_hook``, added before
the backward runs, gone with the graph) adds the squared norm of the gradient it sends into
the trunk to its term's device accumulator: no sync, read with the step's one transfer.
At most ``_MAX_HOOKS`` edges are hooked; a term whose weight is learned (its multiplier
comes from a leaf that requires grad: Kendall's uncertainty weighting) is marked ``learned``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from gradwatch.capture.loss.graph_walk import GraphDesc

__all__ = ["TermInfo", "TermShares"]

_MAX_TERMS = 8
_MAX_HOOKS = 64
_MAX_REACH = 50_000  # node visits per attribution, at most


@dataclass
class TermInfo:
    """One term of a summed loss."""

    label: str  # e.g. "mse_loss", "cross_entropy"
    weight: Optional[float]  # an explicit constant multiplier (0.5 * l_box), if any
    learned: bool  # multiplied by something that trains (uncertainty weighting)
    module: Optional[str]  # the module whose output it takes, where known


_LABELS = {
    "NllLossBackward0": "cross_entropy",
    "NllLoss2DBackward0": "cross_entropy",
    "MseLossBackward0": "mse_loss",
    "L1LossBackward0": "l1_loss",
    "SmoothL1LossBackward0": "smooth_l1_loss",
    "HuberLossBackward0": "huber_loss",
    "BinaryCrossEntropyBackward0": "binary_cross_entropy",
    "BinaryCrossEntropyWithLogitsBackward0": "binary_cross_entropy_with_logits",
}
_SCALE = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})


def _describe_term(g: GraphDesc, i: int) -> tuple[TermInfo, int]:
    """The term rooted at node ``i`` and the node below its scaling."""
    weight: Optional[float] = None
    learned = False
    for _ in range(4):
        n = g.nodes[i]
        if n.kind not in _SCALE or n.shape != ():
            break
        if len(n.inputs) == 1:
            other = n.settings.get("other")
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                weight = float(other) if n.kind.startswith("Mul") else 1.0 / float(other or 1)
            i = n.inputs[0]
            continue
        if len(n.inputs) == 2:  # a weight that trains (exp(-s) * L): follow L
            a, b = n.inputs
            if _is_weight(g, a) or _is_weight(g, b):
                learned = True
                i = b if _is_weight(g, a) else a
                continue
            break
        break
    n = g.nodes[i]
    label = _LABELS.get(n.kind) or _reduced(g, i)
    mark = g.upstream_mark(i)
    return TermInfo(label, weight, learned, mark.module or mark.cls if mark else None), i


class TermShares:
    """The hooks and accumulators of one window's summed losses."""

    def __init__(self) -> None:
        self.terms: list[TermInfo] = []
        self._sums: list[Optional[torch.Tensor]] = []

    def attach(self, g: GraphDesc, objs: list[Any]) -> None:
        """Hook the edges where each term enters the shared trunk (before the backward)."""
        roots = g.terms()
        if g.truncated or len(roots) < 2 or len(roots) > _MAX_TERMS:
            return
        infos = [_describe_term(g, r) for r in roots]
        reach = _reach(g, [i for _, i in infos])
        if reach is None:
            return
        if self.terms and [t.label for t in self.terms] != [t.label for t, _ in infos]:
            return  # another loss in the same window (a GAN's D and G): judged apart
        if not self.terms:
            self.terms = [t for t, _ in infos]
            self._sums = [None] * len(infos)
        hooks = 0
        for i, owners in enumerate(reach):
            if len(owners) != 1 or hooks >= _MAX_HOOKS:
                continue
            (t,) = owners
            fn = objs[i]
            slots = _shared_slots(g, fn, i, reach)
            if slots:
                fn.register_hook(self._hook(t, slots))
                hooks += 1

    def _hook(self, t: int, slots: list[int]) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            total = None
            for s in slots:
                gi = grad_inputs[s] if s < len(grad_inputs) else None
                if gi is not None:
                    sq = gi.detach().float().pow(2).sum()
                    total = sq if total is None else total + sq
            if total is not None:
                old = self._sums[t]
                self._sums[t] = total if old is None else old + total.to(old.device)

        return hook

    def values(self) -> list[torch.Tensor]:
        """The per-term squared norms for the step's transfer (zeros for a silent term)."""
        if not self.terms or all(s is None for s in self._sums):
            return []
        dev = next(s for s in self._sums if s is not None).device
        zero = torch.zeros((), device=dev)
        return [torch.stack([s.to(dev) if s is not None else zero for s in self._sums])]

    def take(self, values: list[float]) -> Optional[tuple[list[TermInfo], list[float]]]:
        """This window's terms and the norm of the gradient each sent into the trunk."""
        terms, self.terms, self._sums = self.terms, [], []
        if not terms or len(values) != len(terms):
            return None
        return terms, [max(v, 0.0) ** 0.5 for v in values]


def _reduced(g: GraphDesc, i: int) -> str:
    """A hand-written term's label: ``mean(abs)`` is an L1, ``mean(pow)`` a squared error."""
    n = g.nodes[i]
    kind = n.kind.replace("Backward0", "").replace("Backward1", "").lower()
    if kind in ("mean", "sum") and n.inputs:
        inner = g.nodes[n.inputs[0]].kind
        if inner.startswith("Abs"):
            return "l1_loss"
        if inner.startswith("Pow"):
            return "squared_error"
    return kind


def _is_weight(g: GraphDesc, j: int) -> bool:
    """Node ``j`` is a few elementwise ops on a small leaf (``exp(-log_var)``, ``1/s**2``)."""
    for _ in range(4):
        n = g.nodes[j]
        if n.leaf:
            return n.shape is not None and len(n.shape) <= 1 and (not n.shape or n.shape[0] <= 16)
        if len(n.inputs) != 1:
            return False
        j = n.inputs[0]
    return False


def _reach(g: GraphDesc, roots: list[int]) -> Optional[list[set[int]]]:
    """For each node, the terms that reach it (``None``: past the visit budget)."""
    owners: list[set[int]] = [set() for _ in g.nodes]
    visits = 0
    for t, r in enumerate(roots):
        stack = [r]
        while stack:
            i = stack.pop()
            if t in owners[i]:
                continue
            owners[i].add(t)
            visits += 1
            if visits > _MAX_REACH:
                return None
            stack.extend(g.nodes[i].inputs)
    return owners


def _shared_slots(g: GraphDesc, fn: Any, i: int, reach: list[set[int]]) -> list[int]:
    """Positions in ``fn.next_functions`` of inputs that several terms reach (the trunk)."""
    out = []
    inputs = iter(g.nodes[i].inputs)
    for pos, (nxt, _) in enumerate(getattr(fn, "next_functions", ())):
        if nxt is None:
            continue
        j = next(inputs, None)
        if j is not None and len(reach[j]) > 1:
            out.append(pos)
    return out
