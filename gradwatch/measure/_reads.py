"""How one group of small tensors, or one large tensor, is read for a fingerprint.

:mod:`gradwatch.measure.fingerprint` reads each group of its plan
(:mod:`gradwatch.measure._fingerprint_plan`) before and after a step with these: the flat
values, exact checksums of the bit patterns and the sampled values, then what changed.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors

from gradwatch.measure._fingerprint_plan import Big, Group
from gradwatch.measure.chunked import row_nonzeros

__all__ = ["big_values", "checksum", "group_changes", "group_values", "sample", "sample_key"]

_F32 = torch.float32


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns as integers (exact: upcasting a float is injective)."""
    if flat.element_size() == 2:
        flat = flat.to(_F32)
    return flat.view(torch.int64 if flat.element_size() == 8 else torch.int32)


def group_values(
    tensors: list[torch.Tensor], g: Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the flat vector, per-member checksums, sampled values) of one group."""
    members = [tensors[k] for k in g.members]
    if g.uniform and len(members) > 1:  # one shape: the same layout as a flatten, faster
        flat = torch.stack(members).view(-1)
        if flat.numel() != g.total:  # a member resized through ``.data`` since the plan
            raise ValueError("the tensors changed size since they were planned")
        # int32 accumulation wraps (modulo 2**32, all a checksum needs): 2.5x faster than int64
        sums = _bits(flat).view(len(members), -1).sum(1, dtype=torch.int32)
        return flat, sums, flat.index_select(0, g.sample_idx).to(_F32)
    flat = _flatten_dense_tensors(members) if len(members) > 1 else members[0].reshape(-1)
    if flat.numel() != g.total:
        raise ValueError("the tensors changed size since they were planned")
    # Per-member sums of the bit patterns: a wrapping cumulative sum read at each member's
    # end (differences of a wrapping sum are exact modulo 2**32).
    cs = _bits(flat).cumsum(0, dtype=torch.int64).index_select(0, g.ends)
    sums = torch.diff(cs, prepend=cs.new_zeros(1))
    # index_select copies (no alias), 3.5x faster than indexing with a tensor (measured)
    return flat, sums, flat.index_select(0, g.sample_idx).to(_F32)


def big_values(t: torch.Tensor, b: Big) -> tuple[torch.Tensor, torch.Tensor]:
    """(checksum, sampled values) of one large tensor."""
    return checksum(t), sample(t, b)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bit patterns modulo 2**32 (int64, one element)."""
    flat = t.detach().view(-1)
    bits = _bits(flat) if flat.element_size() != 2 else flat.view(torch.int16)
    # int32 accumulation wraps (modulo 2**32) and is several times faster than int64 here.
    total = bits.sum(dtype=torch.int32 if bits.element_size() <= 4 else torch.int64)
    return total.to(torch.int64).reshape(1)


def sample_key(b: Big) -> tuple[int, int, int]:
    """What identifies a large tensor's sample: (offset, stride, count)."""
    return b.offset, b.stride, b.m


def sample(t: torch.Tensor, b: Big) -> torch.Tensor:
    """A large tensor's strided sample, float32 (a view for float32: clone to keep it)."""
    flat = t.detach().view(-1)
    return flat[b.offset : b.offset + (b.m - 1) * b.stride + 1 : b.stride].to(_F32)


def group_changes(
    g: Group, c: torch.Tensor, s: torch.Tensor, was: torch.Tensor, old: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(changed, update-norm estimate, moved share) of one group's members.

    ``c``, ``s``: the checksums and samples now; ``was``, ``old``: the fingerprint's.
    """
    d = s - old
    if g.uniform:  # rows of one length: row sums beat a segment reduction (measured)
        rows = d.view(len(g.members), -1)
        moved = row_nonzeros(rows.abs())  # 2 x faster than summing ``rows != 0`` (200 x 64)
        est = (rows * rows).sum(1)
    else:
        moved = torch.segment_reduce((d != 0).to(_F32), "sum", lengths=g.sample_lengths)
        est = torch.segment_reduce(d * d, "sum", lengths=g.sample_lengths)
    changed = ((c != was) | (moved > 0)).to(_F32)
    return changed, est.mul_(g.scale).sqrt_(), moved.div_(g.sample_counts)
