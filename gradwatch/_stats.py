"""Gradient maths as plain functions: batched norms on device, one host transfer per device.

Norms use ``torch._foreach_norm`` grouped by device and dtype, as ``clip_grad_norm_`` does,
and accumulate in float32 so that fp16/bf16 gradients do not overflow or lose the signal.
Nothing here calls ``.item()``: values stay tensors until :func:`to_host` moves them once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["foreach_norms", "layer_norm", "median", "to_host"]

_F32 = torch.float32


def _dense_norm(t: torch.Tensor, ord: float) -> torch.Tensor:
    if t.is_sparse:
        t = t.coalesce()._values()
    return torch.linalg.vector_norm(t.detach(), ord, dtype=_F32 if t.is_floating_point() else None)


def foreach_norms(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """Per-tensor vector norms (0-dim float32 tensors) in input order.

    ``ord=0`` counts non-zero elements, ``ord=1`` sums absolute values, ``inf`` is max |x|.
    Sparse tensors are normed over their stored values.
    """
    if not tensors:
        return []
    try:
        # One call for the common case: dense floating tensors (mixed dtypes and devices are
        # grouped inside the kernel); accumulating in float32 keeps fp16/bf16 from overflowing.
        # Callers run under no_grad, so no per-tensor detach is needed.
        batch = tensors if isinstance(tensors, list) else list(tensors)
        return list(torch._foreach_norm(batch, ord, dtype=_F32))
    except (RuntimeError, TypeError, NotImplementedError):
        pass  # sparse, integer or complex tensors, or a torch without dtype=: group by hand
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for k, t in enumerate(tensors):
        if t.is_sparse or not (t.is_floating_point() or t.is_complex()):
            out[k] = _dense_norm(t, ord)
        else:
            groups[(t.device, t.dtype)].append(k)
    for (_device, dtype), idxs in groups.items():
        # Gradients rarely require grad (only under create_graph): skip a detach per tensor.
        batch = [t.detach() if t.requires_grad else t for t in (tensors[k] for k in idxs)]
        kwargs = {"dtype": _F32} if dtype in (torch.float16, torch.bfloat16) else {}
        norms: Sequence[torch.Tensor]
        try:
            norms = torch._foreach_norm(batch, ord, **kwargs)
        except (RuntimeError, TypeError):  # older torch without dtype=, or an unsupported ord
            norms = [_dense_norm(t, ord) for t in batch]
        for k, n in zip(idxs, norms):
            out[k] = n
    done = [n for n in out if n is not None]
    return [n if n.dtype == _F32 else n.to(_F32) for n in done]


def to_host(values: Sequence[torch.Tensor]) -> list[float]:
    """Move 0-dim tensors to Python floats with one transfer per device (usually one)."""
    if not values:
        return []
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for k, v in enumerate(values):
        by_device[v.device].append(k)
    out = [0.0] * len(values)
    for idxs in by_device.values():
        # Norms are already 0-dim float32: reshape/cast only the others (a bool flag, the
        # scaler's 1-element scale), since two dispatcher calls per value cost more than the norms.
        stacked = torch.stack(
            [
                v if v.dtype is _F32 and v.dim() == 0 else v.reshape(()).to(_F32)
                for v in (values[k] for k in idxs)
            ]
        )
        for k, x in zip(idxs, stacked.tolist()):
            out[k] = x
    return out


def layer_norm(norms: Sequence[float]) -> float:
    """The L2 norm of a layer from the L2 norms of its parameters."""
    return math.sqrt(sum(n * n for n in norms))


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])
