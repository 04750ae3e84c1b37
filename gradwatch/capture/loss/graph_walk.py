"""A compact description of a loss's autograd graph: node kinds, output shapes, a few saved
settings, which module produced which node, and the terms of a summed loss.

Built by :func:`describe` from the root's ``grad_fn`` (``next_functions``, in Python, at most
``max_nodes`` nodes: bounded by the graph's size, never by its data). Nothing is read from a
tensor's values: a node's output shape is autograd's own metadata (``_input_metadata``), its
settings are the plain numbers it saved (``_saved_dim``, ``_saved_reduction``). No reference
to the graph is kept, so describing it never keeps it alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = [
    "COMPILED",
    "PASS_THROUGH",
    "GraphDesc",
    "Mark",
    "NodeInfo",
    "describe",
]

#: Ops that move, cast or select values without changing what they mean (a view, a dtype
#: cast under autocast, a slice): a rule looks through them from a loss to its input.
PASS_THROUGH = frozenset(
    {
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "TBackward0",
        "CloneBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "IndexBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "ToCopyBackward0",
        "AliasBackward0",
        "ClampMinBackward0",
        "ClampBackward1",
        "MaskedSelectBackward0",
        "ContiguousBackward0",
        "FlattenBackward0",
    }
)
#: The node a compiled region (torch.compile's AOTAutograd) leaves: one opaque node.
COMPILED = frozenset({"CompiledFunctionBackward", "CompiledFunction"})

_SCALAR_ONLY = frozenset({"MulBackward0", "DivBackward0"})  # their scalars only: cheap
_SETTINGS = ("_saved_dim", "_saved_reduction", "_saved_other", "_saved_p", "_saved_train")


@dataclass(frozen=True)
class Mark:
    """A module whose forward output a node is (``capture.module_outputs``)."""

    module: str  # its qualified name in the watched model ("" the model itself)
    cls: str  # its class name
    training: bool  # its mode when it ran
    params: bool  # it owns parameters (directly or below): a part of the model, not a loss


@dataclass
class NodeInfo:
    """One node: its kind, its output shape, its inputs (indices), what it saved."""

    kind: str
    shape: Optional[tuple[int, ...]]
    inputs: tuple[int, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    mark: Optional[Mark] = None
    leaf: bool = False  # an AccumulateGrad (a leaf tensor's gradient sink)
    consts: int = 0  # inputs that need no gradient (a target, a constant)
    # A leaf's tensor, weakly (a finding names the parameters upstream of a node by it).
    variable: Optional[weakref.ref[torch.Tensor]] = None


@dataclass
class GraphDesc:
    """One backward's graph, from its root (node 0)."""

    nodes: list[NodeInfo]
    truncated: bool  # the walk stopped at ``max_nodes``
    window: int  # the optimizer window it ran in (windows closed before it)
    backward_at: Optional[str] = None  # the ``backward()`` line (``train.py:42``)
    compiled: int = 0  # opaque compiled-region nodes met (their inside is not seen)
    marked: bool = False  # module outputs were marked (the forward was observed)
    batch: Optional[int] = None  # the watched model's input's first dim (its batch), if seen
    model: str = ""  # the watched model's class name (module "" in findings)
    time_major: bool = False  # it holds a module with batch_first=False: dim 0 may be time

    def node(self, i: int) -> NodeInfo:
        return self.nodes[i]

    def through(self, i: int) -> int:
        """The first node at or below ``i`` that is not a pass-through op with one input."""
        seen = 0
        while seen < 64:
            n = self.nodes[i]
            if n.kind not in PASS_THROUGH or len(n.inputs) != 1:
                return i
            i = n.inputs[0]
            seen += 1
        return i

    def loss_region(self) -> set[int]:
        """The nodes reachable from the root without entering a module that owns parameters
        (what the loss computes on the model's outputs). Without marks, none is known."""
        if not self.marked:
            return set()
        out = {0}
        stack = [0]
        while stack:
            i = stack.pop()
            for j in self.nodes[i].inputs:
                mark = self.nodes[j].mark
                if j in out or (mark is not None and mark.params):
                    continue
                out.add(j)
                stack.append(j)
        return out

    def in_model(self) -> set[int]:
        """The nodes computed inside a watched module's forward: the marked ones and those
        below them (a loss computed outside the model is not in it; HF's, inside, is)."""
        out = {i for i, n in enumerate(self.nodes) if n.mark is not None}
        stack = list(out)
        while stack:
            for j in self.nodes[stack.pop()].inputs:
                if j not in out:
                    out.add(j)
                    stack.append(j)
        return out

    def consumer_mark(self, i: int) -> Optional[Mark]:
        """The nearest module output that node ``i`` flows into (the module that ran it)."""
        parents: dict[int, list[int]] = {}
        for k, n in enumerate(self.nodes):
            for j in n.inputs:
                parents.setdefault(j, []).append(k)
        frontier, seen = [i], {i}
        while frontier:
            nxt = []
            for k in frontier:
                if self.nodes[k].mark is not None:
                    return self.nodes[k].mark
                for p in parents.get(k, ()):
                    if p not in seen:
                        seen.add(p)
                        nxt.append(p)
            frontier = nxt
        return None

    def upstream_mark(self, i: int) -> Optional[Mark]:
        """The nearest module output below node ``i`` (what its inputs came from)."""
        frontier, seen = list(self.nodes[i].inputs), set(self.nodes[i].inputs)
        while frontier:
            nxt = []
            for k in frontier:
                if self.nodes[k].mark is not None:
                    return self.nodes[k].mark
                for j in self.nodes[k].inputs:
                    if j not in seen:
                        seen.add(j)
                        nxt.append(j)
            frontier = nxt
        return None

    def enclosing(self, i: int) -> Optional[str]:
        """The module whose forward ran node ``i``: its own mark, else the innermost module
        holding both the module it flows into and the one its inputs came from."""
        own = self.nodes[i].mark
        if own is not None:
            return own.module
        down, up = self.consumer_mark(i), self.upstream_mark(i)
        if down is None:
            return None
        if up is None:
            return down.module
        a, b = down.module.split("."), up.module.split(".")
        common: list[str] = []
        for x, y in zip(a, b):
            if x != y or not x:
                break
            common.append(x)
        return ".".join(common)

    def producer(self, i: int) -> Optional[Mark]:
        """The module whose output node ``i`` is, looking down through pass-through ops."""
        for _ in range(64):
            n = self.nodes[i]
            if n.mark is not None:
                return n.mark
            if n.kind not in PASS_THROUGH or len(n.inputs) != 1:
                return None
            i = n.inputs[0]
        return None

    def terms(self) -> list[int]:
        """The terms of a summed loss: the root's ``AddBackward0`` tree (a term scaled by a
        number, ``0.5 * l_box``, is one term), as node indices, below a scaling of the whole
        (a GradScaler's ``loss * scale``, accumulation's ``loss / k``); one term: ``[root]``."""
        top = 0
        for _ in range(4):
            n = self.nodes[top]
            if n.kind.startswith(("Mul", "Div")) and n.shape == () and len(n.inputs) == 1:
                top = n.inputs[0]
            else:
                break
        out: list[int] = []
        stack = [top]
        while stack and len(out) < 32:
            i = stack.pop()
            n = self.nodes[i]
            if n.kind in ("AddBackward0", "SubBackward0") and n.shape == () and n.inputs:
                stack.extend(reversed(n.inputs))
            else:
                out.append(i)
        return out


def _setting(node: Any, name: str) -> Any:
    try:
        v = getattr(node, name)
    except Exception:  # a saved tensor already freed, or not a number
        return None
    if isinstance(v, bool) or isinstance(v, float):
        return v
    if isinstance(v, torch.Tensor):  # a Python number autograd wrapped (always on the CPU)
        return float(v.detach()) if v.numel() == 1 and v.device.type == "cpu" else None
    if isinstance(v, int):
        return v - (1 << 64) if v >= (1 << 63) else v  # autograd saves dims as unsigned
    return None


def _weak(node: Any) -> Optional[weakref.ref[torch.Tensor]]:
    try:
        return weakref.ref(node.variable)
    except Exception:  # a leaf already freed, or a tensor type without weak references
        return None


def _shape(node: Any) -> Optional[tuple[int, ...]]:
    try:
        meta = node._input_metadata
        return tuple(meta[0].shape) if meta else None
    except Exception:  # a torch without the metadata, or a nested tensor
        return None


def describe(
    root: Any,
    marks: dict[int, Mark],
    *,
    max_nodes: int,
    window: int,
    settings_of: frozenset[str] = frozenset(),
    keep: Optional[list[Any]] = None,
) -> GraphDesc:
    """Walk the graph from ``root`` (a ``grad_fn``), at most ``max_nodes`` nodes.

    ``marks``: ``id(grad_fn)`` -> the module whose output it is, for grad_fns the caller
    keeps alive until this walk (ids are only valid while their objects live).
    ``settings_of``: node kinds whose saved settings (``_saved_dim``, ...) are read.
    ``keep``: filled with the nodes in index order, for a caller that hooks some of them
    before the backward (and drops the list then).
    """
    index: dict[int, int] = {id(root): 0}
    objs: list[Any] = [root]
    nodes: list[NodeInfo] = []
    compiled = 0
    dropped = False
    i = 0
    while i < len(objs):
        fn = objs[i]
        kind = type(fn).__name__
        inputs: list[int] = []
        consts = 0
        leaf = hasattr(fn, "variable")
        if kind in COMPILED:
            compiled += 1
        for nxt, _ in () if leaf else fn.next_functions:
            if nxt is None:
                consts += 1
                continue
            j = index.get(id(nxt))
            if j is None:
                if len(objs) >= max_nodes:
                    dropped = True
                    continue
                j = len(objs)
                index[id(nxt)] = j
                objs.append(nxt)
            inputs.append(j)
        info = NodeInfo(kind, _shape(fn), tuple(inputs), leaf=leaf, consts=consts)
        if leaf:
            info.variable = _weak(fn)
        info.mark = marks.get(id(fn))
        if kind in settings_of and (kind not in _SCALAR_ONLY or info.shape == ()):
            for name in _SETTINGS:
                v = _setting(fn, name)
                if v is not None:
                    info.settings[name[7:]] = v
        nodes.append(info)
        i += 1
    if keep is not None:
        keep.extend(objs)
    objs.clear()  # no reference to the graph outlives the walk (but the caller's ``keep``)
    return GraphDesc(nodes, dropped, window, compiled=compiled, marked=bool(marks))
