"""Statistics of large CPU tensors, each tensor read from memory once.

Per large tensor, ``norms`` used to run one kernel per statistic, each reading the whole
tensor from memory; on the CPU ``_foreach_norm(1)`` and ``_foreach_norm(0)`` are also
several times slower than a BLAS dot. Here each tensor is walked in cache-sized chunks:
one ``abs`` into a reused buffer, then the sum, the max, the count and the sum of squares
read the chunk while it is in cache (:func:`abs_stats`, a gradient's four statistics);
:func:`norms_and_checksums` does the same for a parameter's norm and checksum after the
step. On 8 x Linear(2048, 2048) the gradients no longer fit the CPU's private caches and
each extra read costs as much as the arithmetic; the separate kernels read the gradients
twice and the parameters twice.

The sums of squares are float32 dots per chunk, added in double: relative error about
1e-6 on Gaussian values and 1e-5 on heavy-tailed ones at 512K-element chunks (less at
256K), where the float32 ``_foreach_norm`` (``clip_grad_norm_``'s) gave 4e-5 (measured,
786K elements).
Squares beyond float32's range overflow to Inf (a norm above about 1.8e19 per chunk) or
underflow, exactly as the float32 ``_foreach_norm`` this replaces did on the CPU (checked:
it returns Inf for 1e25-sized values and 0 for 1e-30-sized ones).
NaN and Inf propagate as before (a NaN counts as non-zero, as ``count_nonzero`` has it).
The one value read on the host, a chunk's min |x|, only skips counting where no element
can be zero; these are CPU tensors, so it waits for no device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

__all__ = [
    "ABS_CHUNK",
    "CHUNK",
    "abs_stats",
    "norms_and_checksums",
    "row_nonzeros",
    "stacked_stats",
]

# Elements per chunk: 2 MiB of float32, which the last-level cache holds between the passes
# over a chunk. On this host (1 MiB L2 per core, 32 MiB L3; 8 x 4M float32, one thread)
# abs_stats took 19.3, 16.6, 14.9, 13.6, 13.2 and 15.0 ms at 64K, 128K, 256K, 512K, 1M and
# 4M elements: per-kernel overhead below, spills above. 512K over 1M leaves room for smaller
# caches.
CHUNK = 1 << 19
# abs_stats' chunk, the size of its buffer of |x|. That buffer is the largest temporary of a
# statistics step, and the allocator keeps its memory after it is freed: at 512K elements
# gradwatch's extra peak on 6 x Linear(4096, 4096) was 0.96 % of the weights, at 256K 0.68 %
# (issue 49's goal: 1 %). abs_stats is 1.5-2 % slower at 256K (11.8 against 11.6 ms on
# 8 x 4M, interleaved); norms_and_checksums, which has no buffer, was 8 % slower, so it keeps
# CHUNK.
ABS_CHUNK = 1 << 18
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}


def row_nonzeros(absolute: torch.Tensor) -> torch.Tensor:
    """Non-zero values per row of a float32 matrix of absolute values, as float32.

    |x|'s bit pattern is 0 exactly where x is 0 (-0.0 included; NaN's is not): clamped to 1
    and summed in int32, 4 x faster than ``count_nonzero`` on 200 x 256 (measured), and
    the same counts.

    Example:
        >>> row_nonzeros(torch.tensor([[0.0, float("nan"), 2.0], [0.0, 0.0, 1e-45]])).tolist()
        [2.0, 1.0]
    """
    bits = absolute.view(torch.int32).clamp(max=1)
    return bits.sum(1, dtype=torch.int32).to(torch.float32)


def _dense_cpu(tensors: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
    """The shared dtype of dense, non-empty float32/float64 CPU tensors, else None."""
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.dtype != dtype or t.numel() == 0:
            return None
    return dtype if dtype in (torch.float32, torch.float64) else None


def _by_tensor(chunks: list[int], *rows: tuple[torch.Tensor, str]) -> list[torch.Tensor]:
    """Reduce per-chunk rows to per-tensor values (``chunks``: how many chunks per tensor)."""
    if len(chunks) == rows[0][0].numel():  # one chunk per tensor
        return [v for v, _ in rows]
    lengths = torch.tensor(chunks)
    return [torch.segment_reduce(v, how, lengths=lengths) for v, how in rows]


def abs_stats(tensors: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """(sum |x|, max |x|, non-zero count, L2 norm) per tensor as four float32 vectors, or None.

    None where this path does not apply (not dense float32/float64 CPU tensors). Each tensor
    is read from memory once: the four statistics read its chunk while it is in cache.

    Example:
        >>> l1, mx, nnz, l2 = abs_stats([torch.tensor([3.0, -4.0, 0.0])])
        >>> l1.tolist(), mx.tolist(), nnz.tolist(), l2.tolist()
        ([7.0], [4.0], [2.0], [5.0])
    """
    dtype = _dense_cpu(tensors)
    if dtype is None:
        return None
    buf = torch.empty(min(ABS_CHUNK, max(t.numel() for t in tensors)), dtype=dtype)
    bits = buf.view(_INT_OF[dtype])
    sums: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    counts: list[int] = []
    squares: list[torch.Tensor] = []
    chunks: list[int] = []  # chunks per tensor
    for t in tensors:
        parts = t.detach().reshape(-1).split(ABS_CHUNK)
        chunks.append(len(parts))
        for c in parts:
            m = c.numel()
            # The dot reads the chunk from memory first, then abs finds it in cache: 3-4 %
            # less than abs first (a read-only stream beats a read and a write; measured on
            # 8 x 4M, one thread). x * x is |x| * |x| exactly, the same products in order.
            squares.append(torch.dot(c, c))  # float32, as _foreach_norm (module docstring)
            a, b = torch.abs(c, out=buf[:m]), bits[:m]
            # sum() is torch's cascade sum: exact enough in float32 and about three times
            # faster than a dot with a vector of ones on this CPU (measured, 512K elements).
            sums.append(a.sum())
            # After abs the bit patterns order as the values do, NaN's above Inf's, so the
            # integers' max is the max |x| (NaN where one is) at half a float max's cost;
            # one aminmax gives it and the min pattern in one pass (amax then amin: two).
            low, high = torch.aminmax(b)
            maxes.append(high)
            # A value is zero exactly when its bit pattern is (-0.0 lost its sign bit; NaN
            # stays non-zero). Most gradients hold no exact zero: a min pattern above zero
            # says every value counts; a CPU scalar read, no device to wait for. Otherwise
            # count them: patterns clamped to 1 in place (the chunk's other statistics are
            # taken) and summed in int32, which cannot overflow at ABS_CHUNK elements; a third
            # cheaper than count_nonzero (measured, 256K elements).
            counts.append(m if low.item() > 0 else int(b.clamp_(max=1).sum(dtype=b.dtype)))
    # One stack per statistic for the whole list: per-chunk stacks cost more than the chunk.
    l1, mx, nnz, sq = _by_tensor(
        chunks,
        (torch.stack(sums).double(), "sum"),
        (torch.stack(maxes).view(dtype), "max"),
        (torch.tensor(counts, dtype=torch.float64), "sum"),
        (torch.stack(squares).double(), "sum"),
    )
    f32 = torch.float32
    return [l1.to(f32), mx.to(f32), nnz.to(f32), sq.sqrt_().to(f32)]


def norms_and_checksums(
    tensors: Sequence[torch.Tensor],
    samples: Sequence[tuple[int, int, int]] = (),
    no_sum: Sequence[bool] = (),
) -> Optional[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """(L2 norm as float32, sum of the bit patterns modulo 2**32 as int64, samples) per
    tensor, or None.

    One read of each tensor for both (``measure/fingerprint.py`` wants both of a large
    parameter after the step). The checksum equals the whole tensor's int32 wrapping sum:
    the chunks' wrapping sums add up modulo 2**32 to the same value. None where this path
    does not apply (see :func:`abs_stats`).

    ``samples``: per tensor, (offset, stride, count) of a strided sample of its flattened
    values, taken as float32 copies from each chunk while it is in cache; a strided gather
    after the pass reads the tensor's memory again, about 1 ms for 8 x 8K values of 8 x 4M
    (measured). Empty: no samples (the third item is then empty).

    ``no_sum``: per tensor, True where no checksum is wanted (0 in its place): the integer
    sum is a quarter of the pass (``measure/carry.py``, judged by the samples).

    Example:
        >>> x = torch.tensor([3.0, 4.0, 5.0])
        >>> n, c, s = norms_and_checksums([x], [(1, 1, 2)])
        >>> n.tolist(), c.tolist() == [int(x.view(torch.int32).sum(dtype=torch.int32))], s
        ([7.071067810058594], True, [tensor([4., 5.])])
    """
    dtype = _dense_cpu(tensors)
    if dtype is None:
        return None
    wide = _INT_OF[dtype]
    squares: list[torch.Tensor] = []
    totals: list[torch.Tensor] = []
    chunks: list[int] = []
    taken: list[torch.Tensor] = []
    zero = torch.zeros((), dtype=wide)
    for k, t in enumerate(tensors):
        parts = t.detach().reshape(-1).split(CHUNK)
        chunks.append(len(parts))
        picked: list[torch.Tensor] = []
        summed = not (no_sum and no_sum[k])
        for j, c in enumerate(parts):
            squares.append(torch.dot(c, c))
            # wraps, as the fingerprint's sum
            totals.append(c.view(wide).sum(dtype=wide) if summed else zero)
            if samples:
                _pick(c, j * CHUNK, samples[k], picked)
        if samples:
            taken.append(torch.cat(picked) if picked else torch.empty(0))
    (sq,) = _by_tensor(chunks, (torch.stack(squares).double(), "sum"))
    total = torch.stack(totals).to(torch.int64)
    if len(chunks) != len(totals):  # segment_reduce has no integer sum: add by owner
        owner = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(chunks))
        total = torch.zeros(len(chunks), dtype=torch.int64).index_add_(0, owner, total)
    if wide is torch.int32:  # chunk sums added in int64: wrap back to the int32 sum
        total = total.to(torch.int32).to(torch.int64)
    return sq.sqrt_().to(torch.float32), total, taken


def _pick(c: torch.Tensor, start: int, key: tuple[int, int, int], out: list[torch.Tensor]) -> None:
    """Append the sampled values that fall in chunk ``c`` (flat positions from ``start``) of
    the sample ``key`` = (offset, stride, count), as a float32 copy."""
    offset, stride, count = key
    first = max(0, -(-(start - offset) // stride))  # the first sample index at or after start
    at = offset + first * stride - start
    if first >= count or at >= c.numel():
        return
    n = min(count - first, (c.numel() - 1 - at) // stride + 1)
    out.append(c[at : at + (n - 1) * stride + 1 : stride].to(torch.float32, copy=True))


# -- many small tensors of few shapes: one stack per shape --------------------------------

# tuple of shapes, or ("layout", caller's key, length) -> (positions per shape, input position
# -> output index, or None)
_SHAPES: dict[Any, tuple[list[list[int]], Optional[torch.Tensor]]] = {}


def _shape_plan(
    tensors: Sequence[torch.Tensor], layout: Optional[object] = None
) -> Optional[tuple[list[list[int]], Optional[torch.Tensor]]]:
    known = ("layout", layout, len(tensors)) if layout is not None else None
    found = _SHAPES.get(known) if known is not None else None
    if found is None:
        shapes = tuple([t.shape for t in tensors])
        found = _SHAPES.get(shapes)
        if found is None:
            found = _remember(shapes, _group_by_shape(shapes))
        if known is not None:
            _remember(known, found)
    # Worth it when shapes repeat (stacked layers); one stack per tensor would not pay.
    return found if len(found[0]) * 4 <= len(tensors) else None


def _group_by_shape(
    shapes: tuple[torch.Size, ...],
) -> tuple[list[list[int]], Optional[torch.Tensor]]:
    groups: dict[torch.Size, list[int]] = {}
    for k, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(k)
    order = [k for g in groups.values() for k in g]
    inverse = [0] * len(order)
    for j, k in enumerate(order):
        inverse[k] = j
    index = None if order == inverse else torch.tensor(inverse, dtype=torch.int64)
    return list(groups.values()), index


def _remember(key: Any, plan: Any) -> Any:
    if len(_SHAPES) > 64:  # bounded: a few layouts per process
        _SHAPES.clear()
    _SHAPES[key] = plan
    return plan


def stacked_stats(
    tensors: Sequence[torch.Tensor], ords: Sequence[float], layout: Optional[object] = None
) -> Optional[list[Any]]:
    """Per-tensor norms (float32 vectors, one per ord) of small CPU tensors of few shapes.

    ``torch.stack`` of same-shape tensors is about 2.5x faster than flattening them into one
    vector (measured: 200 x 16x16, one thread), and reductions along rows beat segment
    reductions. None where this does not apply (mixed devices, empty tensors, unique shapes).

    ``layout``: the caller's key for a list whose shapes do not change (the gradients of one
    parameter list); its grouping is then looked up without reading 400 shapes. A stale
    one (a parameter resized in place) is harmless: any grouping whose groups share a shape
    gives the same values, and one that mixes shapes makes ``torch.stack`` raise, which
    drops the key and declines (the caller falls back to the general path).
    """
    plan = _shape_plan(tensors, layout)
    if plan is None:
        return None
    groups, index = plan
    per_ord: list[list[torch.Tensor]] = [[] for _ in ords]
    try:
        for members in groups:
            if tensors[members[0]].numel() == 0:
                return None
            m = torch.stack([tensors[k] for k in members]).reshape(len(members), -1)
            if m.dtype is not torch.float32:
                m = m.to(torch.float32)  # as the flattened path: statistics in float32
            if len(ords) == 1 and ords[0] == 2.0:  # every step's norms: one kernel per group
                per_ord[0].append(torch.linalg.vector_norm(m, 2.0, dim=1))
                continue
            a = m.abs()
            for out, o in zip(per_ord, ords):
                if o == 2.0:
                    out.append(torch.linalg.vector_norm(m, 2.0, dim=1))
                elif o == 1.0:
                    out.append(a.sum(1))
                elif o == math.inf:
                    out.append(a.amax(1))
                elif o == 0.0:
                    out.append(row_nonzeros(a))
                else:
                    return None
    except (RuntimeError, TypeError):  # mixed devices, sparse or other layouts
        if layout is not None:
            _SHAPES.pop(("layout", layout, len(tensors)), None)
        return None
    result: list[Any] = []
    for parts in per_ord:
        v = torch.cat(parts) if len(parts) > 1 else parts[0]
        result.append(v.index_select(0, index) if index is not None else v)
    return result
