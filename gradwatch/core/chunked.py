"""L1, max |x| and non-zero count of large CPU tensors in one pass over memory.

Per large tensor, ``norms`` used to run one kernel per statistic, each reading the whole
tensor from memory; on the CPU ``_foreach_norm(1)`` and ``_foreach_norm(0)`` are also
several times slower than a BLAS dot. Here each tensor is walked in cache-sized chunks:
one ``abs`` into a reused buffer, then the sum (a dot with ones), the max and the count
read the chunk while it is in cache. Measured on 16 x 512K float32 gradients, one thread:
about half the time of the separate kernels. The L2 norm stays with ``_foreach_norm``,
which accumulates in double on the CPU (a float32 dot of squares would overflow above a
norm of about 1.8e19 and hide an exploding gradient). NaN and Inf propagate as before
(a NaN counts as non-zero, as ``count_nonzero`` has it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["CHUNK", "abs_stats"]

CHUNK = 1 << 18  # elements per chunk (1 MiB of float32): best of 16K-256K measured
_ONES: dict[torch.dtype, torch.Tensor] = {}


def _ones(dtype: torch.dtype) -> torch.Tensor:
    found = _ONES.get(dtype)
    if found is None:
        found = _ONES[dtype] = torch.ones(CHUNK, dtype=dtype)
    return found


def abs_stats(tensors: Sequence[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """(sum |x|, max |x|, non-zero count) per tensor as three float32 vectors, or None.

    None where this path does not apply (not dense float32/float64 CPU tensors).

    Example:
        >>> l1, mx, nnz = abs_stats([torch.tensor([1.0, -2.0, 0.0])])
        >>> l1.tolist(), mx.tolist(), nnz.tolist()
        ([3.0], [2.0], [2.0])
    """
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.dtype != dtype or t.numel() == 0:
            return None
    if dtype not in (torch.float32, torch.float64):
        return None
    ones = _ones(dtype)
    buf = torch.empty(min(CHUNK, max(t.numel() for t in tensors)), dtype=dtype)
    rows: list[torch.Tensor] = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        parts = []
        for c in flat.split(CHUNK):
            m = c.numel()
            a = torch.abs(c, out=buf[:m])
            parts.append(
                torch.stack(
                    [
                        torch.dot(a, ones[:m]).double(),
                        a.amax().double(),
                        torch.count_nonzero(a).double(),
                    ]
                )
            )
        if len(parts) == 1:
            rows.append(parts[0])
        else:
            p = torch.stack(parts)
            rows.append(torch.stack([p[:, 0].sum(), p[:, 1].amax(), p[:, 2].sum()]))
    table = torch.stack(rows).to(torch.float32)
    return [table[:, 0], table[:, 1], table[:, 2]]
