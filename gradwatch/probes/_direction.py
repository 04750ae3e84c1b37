"""The directions ``gradient_mismatch`` moves a copy's weights along, never held whole.

One seeded normal draw ``u`` through every parameter of the copy (:class:`Draw`) serves
every direction: a layer's own is ``u`` on its parameters, normalised; the joint one through
every layer is ``u`` weighted per layer (:func:`joint`), normalised. A :class:`Direction`
keeps only a scalar per parameter: ``u`` is drawn again, :data:`CHUNK` values at a time, at
each use. Autograd's gradient is reduced as it is made (:func:`reduce_grads`: a hook per
parameter takes ``g . u`` and ``|g|^2`` and hands autograd back a zero that holds no
memory; at each read of a parameter alone, :class:`Uses`, a large matrix's a block of rows
at a time, :mod:`gradwatch.probes._rowreads`), and the weights to come back to
are the user's own (:func:`bases`; the copy's parameters read them:
:mod:`gradwatch.probes._widened`). What is left of the model's size is one parameter's
gradient while autograd makes it (issue 49's memory budget): on 6 x Linear(4096, 4096) the
probe's peak was 11.8 x the float32 parameter bytes, then 8.0 x, 2.5 x with a float64 copy
of the weights, and 0.3 x with none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cached_property
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from gradwatch.probes._rowreads import by_rows
from gradwatch.probes._stopgrad import walk
from gradwatch.probes._widened import Move, Widened, add_draw

__all__ = ["CHUNK", "Direction", "Draw", "Reduced", "Uses", "bases", "joint", "reduce_grads"]

#: Values drawn at a time: 4 MiB of float32 normals.
CHUNK = 1 << 20


def _mix(seed: int, index: int, chunk: int) -> int:
    return ((seed * 1_000_003 + index) * 1_000_033 + chunk) % (2**63 - 1)


class Draw:
    """A seeded normal vector ``u`` through ``params``, zero on the rows ``masks`` leaves out
    (an embedding's documented gradient masks); drawn afresh a chunk at a time."""

    def __init__(self, params: list[Tensor], seed: int, masks: Any = None) -> None:
        self.params, self.seed = params, seed
        rows = getattr(masks, "rows", {}) if masks is not None else {}
        self.rows = [torch.tensor(sorted(rows[id(p)])) if rows.get(id(p)) else None for p in params]
        self._sq: list[Optional[float]] = [None] * len(params)

    def chunks(
        self, i: int, lo: int = 0, hi: Optional[int] = None
    ) -> Iterator[tuple[int, int, Tensor]]:
        """``(start, end, u[start:end])`` over parameter ``i`` flattened (float32, on CPU),
        a chunk at a time, cut to ``lo:hi`` (all by default: a block of rows' positions)."""
        p, rows = self.params[i], self.rows[i]
        n = p.numel()
        hi = n if hi is None else hi
        width = n // p.shape[0] if p.dim() > 0 and p.shape[0] > 0 else n
        gen = torch.Generator()
        for c, start in enumerate(range(0, n, CHUNK)):
            end = min(start + CHUNK, n)
            if end <= lo or start >= hi:
                continue
            gen.manual_seed(_mix(self.seed, i, c))
            u = torch.randn(end - start, generator=gen, dtype=torch.float32)
            if rows is not None:
                u[torch.isin(torch.arange(start, end) // max(width, 1), rows)] = 0.0
            a, b = max(start, lo), min(end, hi)
            yield a, b, u[a - start : b - start]

    def norm_sq(self, i: int) -> float:
        """``|u_i|^2``: taken by :func:`reduce_grads`, else drawn here once."""
        sq = self._sq[i]
        if sq is None:
            sq = sum(float(torch.dot(u, u)) for _s, _e, u in self.chunks(i))
            self._sq[i] = sq
        return sq

    def keep_norm_sq(self, i: int, sq: float) -> None:
        self._sq[i] = sq

    def dot(self, i: int, g: Tensor) -> float:
        """``g . u_i`` for a tensor of parameter ``i``'s shape, a chunk at a time."""
        g, total = g.detach(), 0.0
        for s, e, u in self.chunks(i):
            part = _wide(_part(g, s, e))
            total += float(torch.dot(part, u.to(part.device, part.dtype)))
        return total


class Reduced:
    """Autograd's gradient as :func:`reduce_grads` kept it: per parameter ``g . u`` and
    ``|g|^2`` (``None`` where the loss does not reach the parameter)."""

    def __init__(self, n: int) -> None:
        self.dots: list[Optional[float]] = [None] * n
        self.sq: list[Optional[float]] = [None] * n
        self.largest = 0  # bytes of the largest gradient taken

    def take(self, draw: Draw, i: int, g: Tensor, lo: int = 0) -> None:
        """Add one gradient of parameter ``i`` (of one of its reads: :class:`Uses`), or of
        its flat positions from ``lo`` on (a block of rows). Its ``|g|^2`` adds the reads'
        squares: the joint direction's weights only."""
        g, dot, sq, usq = g.detach(), 0.0, 0.0, 0.0
        n = g.numel()
        self.largest = max(self.largest, n * g.element_size())
        for a, b, u in draw.chunks(i, lo, lo + n):
            part = _wide(_part(g, a - lo, b - lo))
            u = u.to(part.device, part.dtype)
            dot += float(torch.dot(part, u))
            sq += float(torch.dot(part, part))
            usq += float(torch.dot(u, u))
        if lo == 0 and n == draw.params[i].numel():
            draw.keep_norm_sq(i, usq)
        self.dots[i] = dot + (self.dots[i] or 0.0)
        self.sq[i] = sq + (self.sq[i] or 0.0)

    def layer_norm(self, indices: list[int]) -> float:
        return math.sqrt(sum(self.sq[i] or 0.0 for i in indices))


def _part(g: Tensor, s: int, e: int) -> Tensor:
    """Flat positions ``s:e`` of ``g`` in row-major order, copying at most the rows that
    hold them (a transposed gradient is not copied whole)."""
    if g.is_contiguous() or g.dim() < 2:
        return g.reshape(-1)[s:e]
    width = g[0].numel()
    r0, r1 = s // width, (e - 1) // width + 1
    return g[r0:r1].reshape(-1)[s - r0 * width : e - r0 * width]


class Uses(TorchFunctionMode):
    """Each op that reads a parameter of ``params`` with grad on reads a view of it made for
    that op (``views``: the parameter's index and the view), so that :func:`reduce_grads`
    takes the gradient of each read alone: a parameter read twice (an embedding tied to the
    output layer) never has its reads' gradients summed into one more tensor of its size."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__()
        self.index = {id(p): i for i, p in enumerate(params)}
        self._params = params
        # index, view (or a block of rows: a leaf), its version when made, its flat offset
        self.views: list[tuple[int, Tensor, int, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and not _writes(func, args, kwargs):
            rows = by_rows(func, args, kwargs, self.index, self._keep, self._read)
            if rows is not None:
                return rows
            args, kwargs = tree_map(self._read, (args, kwargs))
        return func(*args, **kwargs)

    def _read(self, x: Any) -> Any:
        i = self.index.get(id(x)) if isinstance(x, Tensor) else None
        if i is None or not x.requires_grad:
            return x
        view = x.view_as(x)
        self._keep(i, view, 0)
        return view

    def _keep(self, i: int, view: Tensor, lo: int) -> None:
        self.views.append((i, view, view._version, lo))

    def reads(self, loss: Tensor) -> list[tuple[int, Tensor, int]]:
        """The reads of ``loss``'s graph to take gradients at, with their flat offsets:
        every parameter's views (a large matrix's blocks of rows: :mod:`._rowreads`), or the
        parameter itself where one of its views was written (autograd cannot hook such a
        view) or where the graph reads it other than through a view (an op the mode did not
        see: its gradient would be lost)."""
        whole = {i for i, v, k, _lo in self.views if v._version != k}
        # held, so their ids stay theirs; a written view's node is never asked for (torch
        # rebuilds it, and crashed doing so for a hook: EmbeddingBag's max_norm)
        nodes = [v.grad_fn for i, v, _k, _lo in self.views if i not in whole]
        ours = {id(n) for n in nodes}
        for node in walk(loss):
            for n, _k in node.next_functions:
                var = getattr(n, "variable", None)
                if var is not None and id(var) in self.index and id(node) not in ours:
                    whole.add(self.index[id(var)])
        kept = [(i, v, lo) for i, v, _k, lo in self.views if i not in whole]
        return kept + [(i, self._params[i], 0) for i in sorted(whole)]


def _writes(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` may write into a parameter it reads: an in-place op, an attribute,
    an embedding with ``max_norm`` (renormalised in place)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):  # __iadd__, __setitem__, a getter
        return name.startswith("__i") or name in ("__setitem__", "__get__", "__set__")
    if name.endswith("_"):
        return True
    if name in ("embedding", "embedding_bag"):
        return (len(args) > 3 and args[3] is not None) or kwargs.get("max_norm") is not None
    return False


def _wide(t: Tensor) -> Tensor:
    """``t`` in float32 at least: a bfloat16 gradient's dot is summed in float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def reduce_grads(loss: Tensor, draw: Draw, uses: Optional[Uses] = None) -> Reduced:
    """One backward pass of ``loss`` to ``draw``'s parameters (to their reads, where
    ``uses`` recorded the evaluation), reduced as each gradient is made; the graph is kept.

    Raises:
        RuntimeError: autograd failed.
    """
    params = draw.params
    out = Reduced(len(params))

    def hook(i: int, lo: int) -> Callable[[Tensor], Optional[Tensor]]:
        def take(g: Tensor) -> Optional[Tensor]:
            if g.layout != torch.strided:  # a sparse embedding's rows: small, kept as is
                out.take(draw, i, g.to_dense(), lo)
                return None
            out.take(draw, i, g, lo)
            return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)

        return take

    reads = uses.reads(loss) if uses is not None else [(i, p, 0) for i, p in enumerate(params)]
    handles = [t.register_hook(hook(i, lo)) for i, t, lo in reads]
    try:
        inputs = [t for _i, t, _lo in reads]
        torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return out


class Direction:
    """``v = c_i u_i`` on the parameters ``indices`` of ``draw``; their values come back from
    ``base`` (one tensor per parameter of the draw) after each move."""

    def __init__(
        self, name: str, names: list[str], draw: Draw, indices: list[int], base: list[Tensor]
    ) -> None:
        self.name, self.names, self.draw, self.indices, self.base = name, names, draw, indices, base
        norm = math.sqrt(sum(draw.norm_sq(i) for i in indices))
        self.coef = {i: (1.0 / norm if norm > 0.0 else 1.0) for i in indices}
        self.offset: Optional[tuple[Direction, float]] = None  # the point moved off base

    @cached_property
    def scale(self) -> float:
        """The size of the weights it moves (at least 1): its steps are relative to it."""
        size = math.sqrt(
            sum(float(torch.linalg.vector_norm(self.base[i])) ** 2 for i in self.indices)
        )
        return max(1.0, size)

    def shift(self, h: float) -> None:
        """The parameters at ``base + h v`` (plus ``offset``'s move; exactly ``base`` at
        ``h = 0`` without one): a :class:`Widened` one reads them so, another is written."""
        for i in self.indices:
            moves = []
            if self.offset is not None and i in self.offset[0].coef:
                moves.append(self.offset[0].move(i, self.offset[1]))
            if h != 0.0:
                moves.append(self.move(i, h))
            p = self.draw.params[i]
            if isinstance(p, Widened):
                p.set_point(self.base[i], moves)
                continue
            with torch.no_grad():
                p.copy_(self.base[i])
                for move in moves:
                    move(p)

    def move(self, i: int, h: float) -> Move:
        """What adds ``h v`` to parameter ``i``'s values, a chunk at a time."""
        alpha = self.coef[i] * h
        return lambda t, lo=0: add_draw(t, self.draw.chunks(i, lo, lo + t.numel()), alpha, lo)

    def directional(self, reduced: Reduced) -> float:
        """Autograd's ``g . v`` from the reduced gradient."""
        return float(sum(self.coef[i] * (reduced.dots[i] or 0.0) for i in self.indices))

    def directional_of(self, grads: list[Optional[Tensor]]) -> float:
        """``g . v`` for gradients given in full, one per parameter of the draw."""
        pairs = ((i, grads[i]) for i in self.indices)
        return float(sum(self.coef[i] * self.draw.dot(i, g) for i, g in pairs if g is not None))


def joint(
    draw: Draw, layers: list[list[int]], reduced: Reduced, base: list[Tensor], names: list[str]
) -> Direction:
    """The direction through every layer, each layer's block weighted by 1 / its gradient's
    norm (at most 1000 x the smallest weight), so that every layer moves the directional
    derivative about alike: a wrong derivative in an early layer of a deep net, whose
    gradient is small, is not lost in the others'."""
    every = [i for block in layers for i in block]
    whole = Direction("(every layer)", names, draw, every, base)
    sizes = [reduced.layer_norm(block) for block in layers]
    top = max(sizes) if sizes else 0.0
    if top <= 0.0:
        return whole
    weight = {i: 1.0 / max(size, 1e-3 * top) for size, block in zip(sizes, layers) for i in block}
    norm = math.sqrt(sum(weight[i] ** 2 * draw.norm_sq(i) for i in every))
    whole.coef = {i: weight[i] / norm if norm > 0.0 else 1.0 for i in every}
    return whole


def bases(copy: nn.Module, model: nn.Module, params: list[Tensor]) -> list[Tensor]:
    """What each parameter of the copy comes back to: the user's own parameter where it
    holds the same values (the copy was made from it, perhaps widened to float64), else a
    copy taken now (float32 where the float64 values are float32's, exactly)."""
    twin = {}
    for (name, c), (other, o) in zip(copy.named_parameters(), model.named_parameters()):
        if name == other and c.shape == o.shape:
            twin[id(c)] = o
    return [_source(p, twin.get(id(p))) for p in params]


def _source(p: Tensor, own: Optional[Tensor]) -> Tensor:
    if isinstance(p, Widened):  # read from the user's own (or its values of its own)
        return p.base()
    if own is not None and own.device == p.device and _same(p.detach(), own.detach()):
        return own.detach()
    return _narrow(p.detach())


def _same(p: Tensor, own: Tensor) -> bool:
    """Whether ``own`` holds ``p``'s values, compared a chunk at a time (no whole copy)."""
    if type(own) is not Tensor and not isinstance(own, nn.Parameter):
        return False  # a DTensor, a quantised tensor: not read as a plain one
    try:
        a, b = p.reshape(-1), own.reshape(-1)
        if a.numel() > CHUNK and not (p.is_contiguous() and own.is_contiguous()):
            return False
        return all(
            torch.equal(a[s : s + CHUNK], b[s : s + CHUNK].to(a.dtype))
            for s in range(0, a.numel(), CHUNK)
        )
    except Exception:
        return False


def _narrow(p: Tensor) -> Tensor:
    """A copy of ``p``: float32 where ``p`` is float64 holding float32 values (exactly)."""
    if p.dtype == torch.float64:
        low = p.to(torch.float32)
        if torch.equal(low.to(torch.float64), p):
            return low
    return p.clone()
