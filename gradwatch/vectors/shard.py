"""Contiguous shards of a flat parameter vector (the maths behind ``ParamMap.shard``).

Rank ``r`` of ``world_size`` owns elements ``[r * n // world_size, (r + 1) * n //
world_size)``: every element belongs to exactly one rank, shard sizes differ by at most
one, and a rank may own no element when there are more ranks than elements. A
:class:`Shard` lists the parameters it covers, whole or in part, so optimizer state or a
checkpoint can be split without padding.

Example:
    >>> shard = shard_spans([("w", 0, 6, (2, 3)), ("b", 6, 2, (2,))], 8, rank=1, world_size=2)
    >>> (shard.start, shard.end), [(p.name, p.start, p.numel, p.partial) for p in shard.pieces]
    ((4, 8), [('w', 4, 2, True), ('b', 0, 2, False)])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["Shard", "ShardPiece", "shard_spans"]

Span = tuple[str, int, int, tuple[int, ...]]  # (name, offset, numel, shape)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that a shard covers.

    Attributes:
        name: the parameter's canonical name.
        start: index of the first covered element within the parameter (row-major).
        numel: number of covered elements.
        offset: position of the first covered element in the flat vector.
        shape: the parameter's full shape.
    """

    name: str
    start: int
    numel: int
    offset: int
    shape: tuple[int, ...]

    @property
    def partial(self) -> bool:
        """Whether the shard covers only part of the parameter."""
        return self.numel != math.prod(self.shape)

    @property
    def stop(self) -> int:
        """One past the last covered element within the parameter."""
        return self.start + self.numel


@dataclass(frozen=True)
class Shard:
    """The contiguous slice ``[start, end)`` of a flat vector that one rank owns.

    Attributes:
        rank: the owner.
        world_size: number of shards.
        start: first flat index owned.
        end: one past the last flat index owned.
        total: length of the whole flat vector.
        pieces: the parameters covered, in flat order (the first and last may be partial).

    Example:
        >>> s = shard_spans([("w", 0, 5, (5,))], 5, rank=0, world_size=2)
        >>> s.take(torch.arange(5.0)).tolist(), s.pieces[0].partial
        ([0.0, 1.0], True)
    """

    rank: int
    world_size: int
    start: int
    end: int
    total: int
    pieces: tuple[ShardPiece, ...]

    @property
    def numel(self) -> int:
        """Number of elements owned."""
        return self.end - self.start

    @property
    def names(self) -> list[str]:
        """Names of the parameters covered, whole or in part."""
        return [p.name for p in self.pieces]

    def take(self, vec: Tensor) -> Tensor:
        """This shard's slice of a full flat vector (a view, no copy).

        Raises:
            ValueError: when ``vec`` is not 1-D with :attr:`total` elements.
        """
        if vec.dim() != 1 or vec.numel() != self.total:
            raise ValueError(
                f"shard of a {self.total}-element vector cannot slice shape {tuple(vec.shape)}"
            )
        return vec[self.start : self.end]


def shard_spans(spans: Sequence[Span], total: int, rank: int, world_size: int) -> Shard:
    """Cut the flat vector covered by ``spans`` into ``world_size`` shards; return ``rank``'s.

    Args:
        spans: ``(name, offset, numel, shape)`` per parameter, contiguous from 0.
        total: the flat vector's length (the sum of the spans).
        rank: which shard, ``0 <= rank < world_size``.
        world_size: number of shards, at least 1.

    Raises:
        ValueError: on a rank or world size out of range.
    """
    for what, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what} must be an int, not {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    start, end = rank * total // world_size, (rank + 1) * total // world_size
    pieces = []
    for name, offset, numel, shape in spans:
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi:
            pieces.append(ShardPiece(name, lo - offset, hi - lo, lo, tuple(shape)))
    return Shard(rank, world_size, start, end, total, tuple(pieces))
