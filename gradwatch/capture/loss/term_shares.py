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
    rows: int = 0  # rows (samples, tokens) of the values where it leaves the loss code
    exit: float = 0.0  # the norm of the gradient it sends there (``take`` fills it in)


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
                w = float(other) if n.kind.startswith("Mul") else 1.0 / float(other or 1)
                weight = w if weight is None else weight * w  # 0.01 * (E * aux): all of it
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
        self._exits: list[Optional[torch.Tensor]] = []

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
            self._exits = [None] * len(infos)
        region = g.loss_region() if g.marked else None
        trunk: list[tuple[Any, int, list[tuple[int, int]]]] = []
        exits: list[tuple[Any, int, list[tuple[int, int]]]] = []
        for i, owners in enumerate(reach):
            if len(owners) != 1:
                continue
            (t,) = owners
            fn = objs[i]
            slots = _edges(g, fn, i, reach, None)
            if slots:
                trunk.append((fn, t, slots))
            if region is None or i in region:  # not inside the model (a head)
                out = _edges(g, fn, i, reach, region)
                if out:
                    exits.append((fn, t, out))
        # a term computed inside the model (HF's router loss) leaves it where it meets the trunk
        left = {t for _, t, _ in exits}
        exits += [e for e in trunk if e[1] not in left]
        hooks = 0
        for edges, acc in ((trunk, self._sums), (exits, self._exits)):
            for fn, t, slots in edges:
                if hooks < _MAX_HOOKS:
                    fn.register_hook(self._hook(acc, t, [pos for pos, _ in slots]))
                    hooks += 1
        rows: list[dict[int, int]] = [{} for _ in infos]
        for _, t, slots in exits:
            rows[t].update((j, _rows(g.nodes[j].shape)) for _, j in slots)
        for info, r in zip(self.terms, rows):
            info.rows = max(info.rows, sum(r.values()))

    def _hook(self, acc: list[Optional[torch.Tensor]], t: int, slots: list[int]) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            total = None
            for s in slots:
                gi = grad_inputs[s] if s < len(grad_inputs) else None
                if gi is not None:
                    sq = gi.detach().float().pow(2).sum()
                    total = sq if total is None else total + sq
            if total is not None:
                old = acc[t]
                acc[t] = total if old is None else old + total.to(old.device)

        return hook

    def values(self) -> list[torch.Tensor]:
        """The per-term squared norms for the step's transfer (zeros for a silent term): at
        the trunk, then where each term leaves the loss code."""
        if not self.terms or all(s is None for s in self._sums):
            return []
        dev = next(s for s in self._sums if s is not None).device
        zero = torch.zeros((), device=dev)
        both = self._sums + self._exits
        return [torch.stack([s.to(dev) if s is not None else zero for s in both])]

    def take(self, values: list[float]) -> Optional[tuple[list[TermInfo], list[float]]]:
        """This window's terms and the norm of the gradient each sent into the trunk (each
        term's ``exit``: the norm where it left the loss code)."""
        terms, self.terms, self._sums, self._exits = self.terms, [], [], []
        if not terms or len(values) != 2 * len(terms):
            return None
        for t, v in zip(terms, values[len(terms) :]):
            t.exit = max(v, 0.0) ** 0.5
        return terms, [max(v, 0.0) ** 0.5 for v in values[: len(terms)]]


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


def _rows(shape: Optional[tuple[int, ...]]) -> int:
    """Rows of a value: its samples (or tokens), every dim but the last (classes, features)."""
    if not shape:
        return 1
    n = 1
    for d in shape[:-1] if len(shape) > 1 else shape:
        n *= d
    return n


def _edges(
    g: GraphDesc, fn: Any, i: int, reach: list[set[int]], region: Optional[set[int]]
) -> list[tuple[int, int]]:
    """``(position in fn.next_functions, node)`` of node ``i``'s inputs that several terms
    reach (the trunk) or, given ``region`` (the loss code, when the forward was marked), that
    lie outside it (a module's output): where the term's gradient leaves the loss code."""
    out = []
    inputs = iter(g.nodes[i].inputs)
    for pos, (nxt, _) in enumerate(getattr(fn, "next_functions", ())):
        if nxt is None:
            continue
        j = next(inputs, None)
        if j is not None and (len(reach[j]) > 1 or (region is not None and j not in region)):
            out.append((pos, j))
    return out
