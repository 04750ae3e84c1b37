"""Parameters of a probe's copy that hold no values: they read the user's (issue 49's budget).

``gradient_mismatch`` compares autograd with finite differences in float64, and a copy of
the model widened with ``.double()`` would hold twice the float32 weights; the forward
probes would hold a copy in the model's dtype. Each parameter of those copies is a
:class:`Widened` tensor instead (:mod:`gradwatch.probes._copies` makes them): of its copy's
dtype to the model, to autograd and to every op, it holds no values of its own. Its values
are the user's own parameter (read, never written) plus the moves the gradient probe adds
(a seeded draw times a step, drawn again at each read), cast for the one op that reads them
and freed after it; where no cast and no move is needed an op reads the user's tensor
itself. A view of it (``weight.t()`` in ``F.linear``) is a :class:`Widened` too, so the
tensors autograd saves for the backward pass hold no memory either, and a matrix larger than
:data:`BLOCK` is read a block of rows at a time by a matrix product or an embedding lookup.
An op that writes into a parameter (a ``.data`` edit in the forward, ``max_norm``) gives it
values of its own first, as a copy's parameter would.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["BLOCK", "Move", "Root", "Widened", "add_draw"]

#: Something that adds a move to a parameter's values in place (a draw times a step): to
#: the whole tensor, or to a block of its rows given its first flat position.
Move = Callable[..., None]
#: A widened matrix of more values than this is read a block of rows at a time by a matrix
#: product or an embedding lookup (32 MiB of float64 a block): a GPT-2's 38.6M-value word
#: embedding, tied to its output layer, is never read whole.
BLOCK = 1 << 22
_aten = torch.ops.aten
_ALIASES = frozenset({_aten.detach.default, _aten.alias.default})
_BLOCKED = frozenset({_aten.mm.default, _aten.addmm.default, _aten.embedding.default})


class Root:
    """One parameter's values, in ``dtype``: ``src`` (the user's tensor, or values of its own
    once an op wrote into it) plus ``moves``."""

    __slots__ = ("dtype", "moves", "src")

    def __init__(self, src: Tensor, dtype: torch.dtype = torch.float64) -> None:
        self.src, self.dtype = src.detach(), dtype
        self.moves: tuple[Move, ...] = ()

    def value(self) -> Tensor:
        """The values, always a fresh tensor (the user's are never written)."""
        out = torch.empty_strided(
            self.src.shape, self.src.stride(), dtype=self.dtype, device=self.src.device
        )
        out.copy_(self.src)
        for move in self.moves:
            move(out)
        return out

    def read(self) -> Tensor:
        """The values for an op that does not write them: ``src`` itself where it holds
        them (a copy that shares the user's weights), else :meth:`value`."""
        return self.src if self.plain() else self.value()

    def plain(self) -> bool:
        return not self.moves and self.src.dtype == self.dtype

    def rows(self, s: int, e: int) -> Tensor:
        """Rows ``s:e`` of :meth:`value` (of a contiguous matrix), read alone."""
        block = self.src[s:e].to(self.dtype, copy=True)
        for move in self.moves:
            move(block, s * self.src.shape[1])
        return block

    def spans(self) -> Iterator[tuple[int, int]]:
        n, width = self.src.shape
        step = max(1, BLOCK // max(width, 1))
        return ((s, min(s + step, n)) for s in range(0, n, step))


def _meta(root: Root) -> Tensor:
    src = root.src
    return torch.empty_strided(src.shape, src.stride(), dtype=root.dtype, device="meta")


class Widened(Tensor):
    """A tensor of its root's dtype whose values are its root's, read at each op (see the
    module)."""

    _gw_root: Root
    _gw_views: tuple[tuple[Any, tuple[Any, ...], dict[str, Any], Optional[int]], ...]
    _gw_meta: Tensor

    @staticmethod
    def __new__(cls, root: Root, views: tuple[Any, ...] = (), meta: Optional[Tensor] = None):  # type: ignore[no-untyped-def]
        meta = _meta(root) if meta is None else meta
        return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=root.dtype,
            device=root.src.device,
            requires_grad=False,
        )

    def __init__(self, root: Root, views: tuple[Any, ...] = (), meta: Optional[Tensor] = None):
        self._gw_root, self._gw_views = root, views
        self._gw_meta = _meta(root) if meta is None else meta

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Widened(shape={tuple(self.shape)})"

    def set_point(self, base: Tensor, moves: Iterable[Move]) -> None:
        """The values at ``base`` plus ``moves`` (``base`` read, never written)."""
        self._gw_root.src = base.detach()
        self._gw_root.moves = tuple(moves)

    def base(self) -> Tensor:
        """The tensor its values are read from (the user's own parameter unless written)."""
        return self._gw_root.src

    def value(self) -> Tensor:
        """Its values: a fresh tensor, or a view of one."""
        return _apply_views(self._gw_root.value(), self._gw_views)

    def read(self) -> Tensor:
        """Its values for an op that does not write them (perhaps the user's own); a block
        of a large matrix's rows is read alone (:mod:`gradwatch.probes._rowreads`)."""
        span = _row_span(self)
        if span is not None:  # then its other views (a block's transpose in a linear layer)
            return _apply_views(self._gw_root.rows(*span), self._gw_views[1:])
        return _apply_views(self._gw_root.read(), self._gw_views)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _BLOCKED and not kwargs:
            out = _blocked(func, args)
            if out is not None:
                return out
        first = args[0] if args else None
        if isinstance(first, Widened):
            if func in _ALIASES:
                return Widened(first._gw_root, first._gw_views, first._gw_meta)
            if getattr(func, "is_view", False):
                out = _view(first, func, args[1:], kwargs)
                if out is not None:
                    return out  # else a view of fresh values, never of the user's tensor
                return func(first.value(), *tree_map(_plain, args[1:]), **tree_map(_plain, kwargs))
        written = _written(func, args, kwargs)
        if written:
            return _write(func, args, kwargs, written)
        return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


def _row_span(x: Widened) -> Optional[tuple[int, int]]:
    """``(s, e)`` where ``x``'s first view takes rows ``s:e`` of its root's contiguous
    matrix, whose values are not the root's source as it is (else ``None``: read as usual)."""
    root, views = x._gw_root, x._gw_views
    if not views or root.plain() or root.src.dim() != 2 or not root.src.is_contiguous():
        return None
    func, args, kwargs, index = views[0]
    if func is not _aten.slice.Tensor or kwargs or index is not None or len(args) < 3:
        return None
    if args[0] != 0 or (len(args) > 3 and args[3] != 1):
        return None
    n = root.src.shape[0]
    s, e = args[1] or 0, n if args[2] is None else min(args[2], n)
    return (s, e) if 0 <= s < e else None


def _plain(x: Any) -> Any:
    return x.read() if isinstance(x, Widened) else x


def _apply_views(out: Tensor, views: tuple[Any, ...]) -> Tensor:
    for func, args, kwargs, index in views:
        out = func(out, *args, **kwargs)
        if index is not None:
            out = out[index]
    return out


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The positions (or keyword names) of ``func``'s arguments it writes that are
    :class:`Widened` (an in-place op's ``self``, an ``out=``)."""
    found: list[Any] = []
    for k, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        where: Any = k if k < len(args) and not arg.kwarg_only else arg.name
        value = args[where] if isinstance(where, int) else kwargs.get(where)
        if isinstance(value, Widened):
            found.append(where)
    return found


def _view(first: Widened, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view op: a :class:`Widened` of the same root with the view appended (its shape
    from the op run on a meta tensor); ``None`` where the op does not run on meta."""
    if any(isinstance(a, Tensor) for a in (*args, *kwargs.values())):
        return None
    try:
        meta = func(first._gw_meta, *args, **kwargs)
    except Exception:
        return None
    root, views = first._gw_root, first._gw_views
    if isinstance(meta, (list, tuple)):
        return type(meta)(
            Widened(root, (*views, (func, args, kwargs, k)), m) for k, m in enumerate(meta)
        )
    return Widened(root, (*views, (func, args, kwargs, None)), meta)


def _write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], written: list[Any]) -> Any:
    """An op writing into :class:`Widened` tensors: each one's root takes values of its own
    (those read, moves included, then written), as a copy's parameter would; the user's
    are never written."""
    given, kwargs = list(args), dict(kwargs)
    targets = [given[w] if isinstance(w, int) else kwargs[w] for w in written]
    roots = []
    for where, target in zip(written, targets):
        values = target._gw_root.value()
        roots.append((target._gw_root, values))
        fresh = _apply_views(values, target._gw_views)
        if isinstance(where, int):
            given[where] = fresh
        else:
            kwargs[where] = fresh
    func(*tree_map(_plain, tuple(given)), **tree_map(_plain, kwargs))
    for root, values in roots:
        root.src, root.moves = values, ()
    return targets[0]  # as an in-place op returns its tensor


def _layout(x: Any) -> Optional[str]:
    """``rows`` where ``x`` is a large widened matrix itself, ``t`` where it is its transpose
    (``weight.t()`` in ``F.linear``), ``None`` otherwise (read whole)."""
    if not isinstance(x, Widened):
        return None
    src, meta = x._gw_root.src, x._gw_meta
    if src.dim() != 2 or src.numel() <= BLOCK or not src.is_contiguous():
        return None
    if x._gw_root.plain():  # read as it is, never copied: no block needed
        return None
    if meta.storage_offset() != 0 or meta.dim() != 2:
        return None
    if tuple(meta.shape) == tuple(src.shape) and meta.stride() == src.stride():
        return "rows"
    if tuple(meta.shape) == tuple(src.shape)[::-1] and meta.stride() == src.stride()[::-1]:
        return "t"
    return None


def _blocked(func: Any, args: tuple[Any, ...]) -> Optional[Tensor]:
    """``mm``, ``addmm`` or ``embedding`` reading a large widened matrix a block of rows at
    a time (:data:`BLOCK`); ``None`` where the op reads it otherwise."""
    if func is _aten.embedding.default:
        if _layout(args[0]) != "rows" or isinstance(args[1], Widened):
            return None
        return _lookup(args[0]._gw_root, args[1])
    if func is _aten.addmm.default and len(args) != 3:
        return None  # beta, alpha
    bias, a, b = args if len(args) == 3 else (None, *args)
    kind = _layout(b)
    if kind is None or isinstance(a, Widened) or a.dim() != 2:
        return None
    root = b._gw_root
    if kind == "t":  # a @ W.T: a block of output columns per block of W's rows
        out = a.new_empty((a.shape[0], b.shape[1]))
        for s, e in root.spans():
            out[:, s:e] = a @ root.rows(s, e).t()
    else:  # a @ W: a partial product per block of W's rows
        out = a.new_zeros((a.shape[0], b.shape[1]))
        for s, e in root.spans():
            out.addmm_(a[:, s:e], root.rows(s, e))
    return out if bias is None else out.add_(_plain(bias))


def _lookup(root: Root, ids: Tensor) -> Tensor:
    """``embedding``'s forward (a row per index) from the blocks of rows that hold them."""
    flat = ids.reshape(-1)
    if not root.moves:
        return root.src.index_select(0, flat).to(root.dtype).view(*ids.shape, -1)
    out = torch.empty((flat.numel(), root.src.shape[1]), dtype=root.dtype, device=root.src.device)
    for s, e in root.spans():
        hit = (flat >= s) & (flat < e)
        if bool(hit.any()):
            out[hit] = root.rows(s, e)[flat[hit] - s]
    return out.view(*ids.shape, -1)


def add_draw(
    t: Tensor, chunks: Iterator[tuple[int, int, Tensor]], alpha: float, lo: int = 0
) -> None:
    """Add ``alpha u`` to ``t`` in place, ``u`` given a chunk of the flattened parameter at a
    time, ``(start, end, u[start:end])`` within ``t``'s positions: ``t`` holds the
    parameter's flat positions from ``lo`` on (a block of rows)."""
    flat = t.view(-1) if t.is_contiguous() else None
    for a, b, u in chunks:
        step = u.to(t.device, t.dtype)
        if flat is not None:
            flat[a - lo : b - lo].add_(step, alpha=alpha)
        else:  # a strided tensor (never a block): its chunk written through its coordinates
            index = torch.arange(a, b, device=t.device)
            t[torch.unravel_index(index, t.shape)] += step.mul_(alpha)
