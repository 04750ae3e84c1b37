"""A large matrix read a block of rows at a time above autograd, each block a leaf of its own.

During ``gradient_mismatch``'s recorded evaluation (:class:`~gradwatch.probes._direction.Uses`)
the weight of a linear layer or of an embedding with more than ``BLOCK`` values, a
:class:`~gradwatch.probes._widened.Widened` matrix, is read as blocks of its rows, each a
new leaf of the same values. Autograd then makes each block's gradient alone (32 MiB of
float64 at most) and the reduction takes it there: a GPT-2's tied 38.6M-value embedding never
has a float64 gradient of its whole size, once for its lookup and once for its output layer
(62 % of the model's float32 bytes, more than the rest of the probe). The values are those
of the whole matrix: a lookup's row is a row, a linear layer's output columns are its rows'
products.

An embedding with ``scale_grad_by_freq`` or ``sparse`` gradients is read whole (its
gradient depends on the lookup's other rows, or is small already), as is a matrix read by
any other op (``x @ w.t()``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from gradwatch.probes import _widened
from gradwatch.probes._widened import Widened

__all__ = ["by_rows"]

Keep = Callable[[int, Tensor, int], None]  # (parameter index, block leaf, its flat offset)

_LINEAR = ("input", "weight", "bias")
_EMBEDDING = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)


def by_rows(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    index: dict[int, int],
    keep: Keep,
    read: Callable[[Any], Any],
) -> Optional[Tensor]:
    """``func(*args, **kwargs)`` with its weight read a block of rows at a time, each block
    handed to ``keep`` (its other tensors through ``read``: a bias's view); ``None`` where
    ``func`` is not a linear layer or a lookup of a large widened matrix of ``index`` (the
    caller runs it as it is)."""
    if func is not F.linear and func is not F.embedding:
        return None
    bound = _bind(_LINEAR if func is F.linear else _EMBEDDING, args, kwargs)
    w, x = bound.get("weight"), bound.get("input")
    i = _large(w, index)
    if i is None or not isinstance(w, Widened) or not isinstance(x, Tensor):
        return None

    def own(block: Tensor, lo: int) -> None:
        keep(i, block, lo)

    if func is F.linear:
        return _linear(read(x), w, read(bound.get("bias")), own)
    if bound.get("max_norm") is not None or bound.get("scale_grad_by_freq") or bound.get("sparse"):
        return None
    return _lookup(x, w, bound.get("padding_idx"), own)


def _bind(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _large(w: Any, index: dict[int, int]) -> Optional[int]:
    """``w``'s index where it is a large widened matrix read as it is (no view of it)."""
    if not isinstance(w, Widened) or not w.requires_grad or id(w) not in index:
        return None
    src = w.base()
    if w._gw_views or src.dim() != 2 or src.numel() <= _widened.BLOCK or not src.is_contiguous():
        return None
    return index[id(w)]


def _leaves(w: Widened) -> list[tuple[int, int, Tensor]]:
    """``(s, e, rows s:e)`` over ``w``'s blocks of rows, each a leaf that requires grad."""
    out = []
    for s, e in w._gw_root.spans():
        block = w.detach()[s:e]
        out.append((s, e, block.requires_grad_(True)))
    return out


def _linear(x: Tensor, w: Widened, bias: Optional[Tensor], keep: Callable[..., None]) -> Tensor:
    width, parts = w.shape[1], []
    for s, e, block in _leaves(w):
        keep(block, s * width)
        parts.append(F.linear(x, block, None if bias is None else bias[s:e]))
    return torch.cat(parts, dim=-1)


def _lookup(ids: Tensor, w: Widened, pad: Optional[int], keep: Callable[..., None]) -> Tensor:
    n, width = w.shape
    if pad is not None and pad < 0:
        pad += n
    flat = ids.reshape(-1)
    out = torch.zeros((flat.numel(), width), dtype=w.dtype, device=w.device)
    for s, e, block in _leaves(w):
        hit = ((flat >= s) & (flat < e)).nonzero().squeeze(1)
        if hit.numel() == 0:
            continue
        keep(block, s * width)
        own = pad - s if pad is not None and s <= pad < e else None
        out = out.index_put((hit,), F.embedding(flat[hit] - s, block, own))
    return out.view(*ids.shape, width)
