"""Gradient maths as plain functions: batched norms on device, one host transfer per device.

On accelerators, norms use ``torch._foreach_norm`` grouped by device and dtype, as
``clip_grad_norm_`` does (fused multi-tensor kernels). On the CPU ``_foreach_norm`` loops
over the tensors (about 3 us each, per statistic); there a list of tensors is flattened once
and every statistic is one segment reduction over it (3x faster for 400 small tensors,
measured). Both accumulate in float32 so fp16/bf16 gradients neither overflow nor lose the
signal. Nothing here calls ``.item()``: values stay tensors until :func:`to_host` moves them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch._utils import _flatten_dense_tensors

from gradwatch.measure.chunked import abs_stats, stacked_stats

__all__ = [
    "Chunk",
    "flatten_cpu",
    "foreach_norms",
    "layer_norm",
    "median",
    "norms",
    "segment_norms",
    "to_host",
]

Chunk = Union[torch.Tensor, list[torch.Tensor]]
"""Per-tensor values: a 1-D float32 vector, or a list of 0-dim float32 tensors."""

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


_LENGTHS: dict[tuple[int, ...], torch.Tensor] = {}
# Flatten when tensors average fewer elements than this: _foreach_norm costs about 3 us per
# tensor on the CPU, a flatten plus a few passes about 1 ns per element (measured).
_FLAT_MAX_MEAN = 2048


def _keep(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    """Store ``value`` in a cache of layouts: bounded (cleared past 64 entries), as a process
    holds a few layouts in practice. Returns ``value``."""
    if len(cache) > 64:
        cache.clear()
    cache[key] = value
    return value


def _lengths(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    key = tuple(t.numel() for t in tensors)
    found = _LENGTHS.get(key)
    if found is None:
        found = _keep(_LENGTHS, key, torch.tensor(key, dtype=torch.int64))
    return found


def _small_cpu(tensors: Sequence[torch.Tensor], layout: Optional[object] = None) -> bool:
    """Dense floating CPU tensors of a small mean size. ``layout``: the caller's key for a
    list of unchanged shapes (as :func:`norms`'s), which keeps the answer: summing 400 sizes
    cost 40 us a step."""
    first = tensors[0]
    if first.device.type != "cpu" or not first.is_floating_point() or first.is_sparse:
        return False
    key = (layout, len(tensors), first.numel()) if layout is not None else None
    found = _SMALL.get(key) if key is not None else None
    if found is None:
        # large tensors: foreach's per-tensor cost is small next to a full copy
        found = sum(map(torch.Tensor.numel, tensors)) <= _FLAT_MAX_MEAN * len(tensors)
        if key is not None:
            _keep(_SMALL, key, found)
    return found


_SMALL: dict[tuple[object, int, int], bool] = {}


def flatten_cpu(tensors: Sequence[torch.Tensor], *, copy: bool = False) -> Optional[torch.Tensor]:
    """All of ``tensors`` as one float32 CPU vector, or None where that does not apply.

    With ``copy`` the result never aliases an input (a single tensor flattens to a view).

    Only the first tensor is inspected: ``cat`` promotes mixed float dtypes (norms stay right)
    and refuses sparse tensors or other devices, which then take the foreach path.
    """
    if not _small_cpu(tensors):
        return None
    flat = _flat32(tensors)
    if flat is not None and copy and len(tensors) == 1 and tensors[0].dtype is _F32:
        return flat.clone()  # a float32 tensor alone flattens to a view of itself
    return flat


def _flat32(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``tensors`` concatenated into one float32 vector, or None where ``cat`` refuses them
    (sparse tensors, several devices)."""
    try:
        flat = _flatten_dense_tensors(tensors if isinstance(tensors, list) else list(tensors))
    except (RuntimeError, TypeError):
        return None
    return flat if flat.dtype is _F32 else flat.to(_F32)


def segment_norms(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], ords: Sequence[float]
) -> list[Chunk]:
    """Per-tensor norms of ``flat`` (``tensors`` flattened and concatenated) for each ord."""
    lengths = _lengths(tensors)
    mag = flat.abs()
    out: list[Chunk] = []
    for o in ords:
        if o == 2.0:
            v = torch.segment_reduce(mag * mag, "sum", lengths=lengths).sqrt_()
        elif o == 1.0:
            v = torch.segment_reduce(mag, "sum", lengths=lengths)
        elif o == math.inf:
            v = torch.segment_reduce(mag, "max", lengths=lengths, initial=0.0)
        elif o == 0.0:
            v = torch.segment_reduce((flat != 0).to(_F32), "sum", lengths=lengths)
        else:
            raise ValueError(f"unsupported norm order {o}")
        out.append(v)
    return out


def norms(
    tensors: Sequence[torch.Tensor], ords: Sequence[float], layout: Optional[object] = None
) -> list[Chunk]:
    """Per-tensor vector norms for each ``ord`` in ``ords``, aligned with ``tensors``.

    ``ord=0`` counts non-zero elements, ``1`` sums absolute values, ``2`` is the L2 norm,
    ``inf`` the max |x|. NaN and Inf propagate. ``layout``: a hashable key the caller keeps
    for tensors of unchanged shapes (the gradients of one parameter list), so that their
    grouping by shape is not rebuilt from 400 shapes every step (see ``stacked_stats``).
    """
    if not tensors:
        return [[] for _ in ords]
    if _small_cpu(tensors, layout):
        together = _together(tensors, ords, layout)
        if together is not None:
            return together
    elif len(ords) > 2 and tensors[0].device.type == "cpu":
        # small tensors beside large ones, all four statistics: each kind its own path (the
        # L2 norms alone are one foreach call, which a split only slows)
        split = _split(tensors, layout)
        mixed = _split_norms(tensors, ords, split, layout) if split is not None else None
        if mixed is not None:
            return mixed
    return _apart(tensors, ords)


def _together(
    tensors: Sequence[torch.Tensor], ords: Sequence[float], layout: Optional[object]
) -> Optional[list[Chunk]]:
    """Norms of small CPU tensors read together: one stack per shape where shapes repeat
    (stacked layers), else one flattened vector; None where neither applies."""
    stacked = stacked_stats(tensors, ords, layout)
    if stacked is not None:
        return stacked
    flat = _flat32(tensors)
    return None if flat is None else segment_norms(flat, tensors, ords)


def _apart(tensors: Sequence[torch.Tensor], ords: Sequence[float]) -> list[Chunk]:
    """Norms of tensors read one by one: large ones, accelerators, sparse or mixed lists."""
    cpu = tensors[0].device.type == "cpu"
    fused = abs_stats(tensors) if cpu and len(ords) > 2 else None
    if fused is not None:  # L1, max, count and L2 in one chunked pass (measure/chunked.py)
        by_ord: dict[float, Chunk] = dict(zip((1.0, math.inf, 0.0, 2.0), fused))
        return [by_ord[o] if o in by_ord else foreach_norms(tensors, o) for o in ords]
    return [
        _cpu_max_abs(tensors) if cpu and o == math.inf else foreach_norms(tensors, o) for o in ords
    ]


# -- a mixed list: biases and norms' weights beside large matrices (transformers, CNNs) ----

# A tensor of at most this many elements joins the small ones. The large path costs a few
# kernels per tensor (about 3 us each on the CPU) and the small one about 1 ns an element
# for the flatten: even at 8K elements the small path is no slower. All four statistics of
# a 12-layer GPT layout (d=256, 148 tensors, 98 small): 7.8 -> 6.7 ms; ResNet-18 (62
# tensors, 42 small): 6.9 -> 6.4 ms (interleaved, one thread).
_SPLIT_MAX = 8192
_SPLIT_MIN = 8  # fewer small tensors than this: not worth the split
_SPLITS: dict[tuple[object, int], Optional[tuple[torch.Tensor, torch.Tensor]]] = {}


def _split(
    tensors: Sequence[torch.Tensor], layout: Optional[object]
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(positions of the small tensors, of the large ones) as int64 vectors, or None where
    a split does not pay. ``layout`` as :func:`norms`'s keeps the answer: a stale one (a
    parameter resized in place) only sends a tensor down the slower path, never a wrong
    value."""
    key = (layout, len(tensors))
    if layout is not None and key in _SPLITS:
        return _SPLITS[key]
    small = [k for k, t in enumerate(tensors) if t.numel() <= _SPLIT_MAX]
    found = None
    # all on the CPU: merging on the host must not copy an accelerator's values there
    if _SPLIT_MIN <= len(small) < len(tensors) and all(t.device.type == "cpu" for t in tensors):
        smalls = set(small)
        large = [k for k in range(len(tensors)) if k not in smalls]
        found = (torch.tensor(small, dtype=torch.int64), torch.tensor(large, dtype=torch.int64))
    return _keep(_SPLITS, key, found) if layout is not None else found


def _split_norms(
    tensors: Sequence[torch.Tensor],
    ords: Sequence[float],
    split: tuple[torch.Tensor, torch.Tensor],
    layout: Optional[object],
) -> Optional[list[Chunk]]:
    """:func:`norms` of a mixed list: the small tensors flattened (or stacked) together, the
    large ones on their own path, merged back in order. None where the small ones cannot be
    flattened together (sparse, other devices): the caller's general path then runs."""
    small_at, large_at = split
    small = [tensors[k] for k in small_at.tolist()]
    if not all(map(torch.is_floating_point, small)):  # complex or integer: the general path
        return None
    part = _together(small, ords, ("small", layout) if layout is not None else None)
    if part is None:
        return None
    rest = _apart([tensors[k] for k in large_at.tolist()], ords)
    out: list[Chunk] = []
    for a, b in zip(part, rest):
        v = torch.empty(len(tensors), dtype=_F32)
        v.index_copy_(0, small_at, _vector(a)).index_copy_(0, large_at, _vector(b))
        out.append(v)
    return out


def _vector(chunk: Chunk) -> torch.Tensor:
    """A chunk as one float32 vector on the CPU."""
    v = chunk if isinstance(chunk, torch.Tensor) else torch.stack(chunk)
    return v.reshape(-1).to(device="cpu", dtype=_F32)


def _cpu_max_abs(tensors: Sequence[torch.Tensor]) -> Chunk:
    """max |x| per tensor on the CPU: ``aminmax`` is one vectorised pass, several times
    faster there than ``_foreach_norm(inf)`` (abs, then max, per tensor; measured)."""
    try:
        mm = [torch.aminmax(t.detach()) for t in tensors]
        lo = torch.stack([m.min for m in mm])
        hi = torch.stack([m.max for m in mm])
        return torch.maximum(hi, -lo).to(_F32)
    except (RuntimeError, TypeError, NotImplementedError):  # sparse, integer, complex, empty
        return foreach_norms(tensors, math.inf)


def to_host(chunks: Sequence[Chunk]) -> list[float]:
    """Move chunks of values to Python floats with one transfer per device (usually one)."""
    vectors: list[torch.Tensor] = []
    for chunk in chunks:
        if isinstance(chunk, torch.Tensor):
            flat = chunk if chunk.dim() == 1 else chunk.reshape(-1)
            vectors.append(flat if flat.dtype is _F32 else flat.to(_F32))
        elif chunk:
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for v in chunk:
                by_device[v.device].append(v.reshape(()).to(_F32))
            if len(by_device) == 1:
                vectors.append(torch.stack(next(iter(by_device.values()))))
            else:  # model parallel: keep order, one transfer per device below
                vectors.extend(torch.stack([v]) for v in chunk)
    if not vectors:
        return []
    device = vectors[0].device
    if all(v.device == device for v in vectors):  # the usual case: already in order
        return (torch.cat(vectors) if len(vectors) > 1 else vectors[0]).tolist()
    by_dev: dict[torch.device, list[int]] = defaultdict(list)
    for k, v in enumerate(vectors):
        by_dev[v.device].append(k)
    parts: list[list[float]] = [[] for _ in vectors]
    for idxs in by_dev.values():
        joined = torch.cat([vectors[k] for k in idxs]).tolist()
        pos = 0
        for k in idxs:
            m = vectors[k].numel()
            parts[k] = joined[pos : pos + m]
            pos += m
    return [x for part in parts for x in part]


def layer_norm(norms: Sequence[float]) -> float:
    """The L2 norm of a layer from the L2 norms of its parameters."""
    return math.hypot(*norms)  # one C call (and no overflow of n * n)


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])
