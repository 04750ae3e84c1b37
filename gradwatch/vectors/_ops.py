"""What a :class:`~gradwatch.vectors.parammap.ParamMap` derives from its flat vector.

Quantization (:mod:`~gradwatch.vectors.quant`), shards (:mod:`~gradwatch.vectors.shard`),
sketches (:mod:`~gradwatch.vectors.sketch`) and the one-collective gradient all-reduce,
as thin methods over those modules that turn their ``ValueError`` into
:class:`~gradwatch.vectors._layout.ParamMapError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from gradwatch.vectors._core import MapCore
from gradwatch.vectors._flat import Missing, Source, bound_tensors, reject_buffers
from gradwatch.vectors._layout import ParamEntry, ParamMapError, _listed
from gradwatch.vectors.quant import Scheme, dequantize_flat, quantize_flat
from gradwatch.vectors.shard import Shard, shard_spans
from gradwatch.vectors.sketch import (
    DEFAULT_CHUNK,
    DEFAULT_DENSITY,
    sketch,
    sketch_tensors,
    unsketch,
)

__all__ = ["VectorOps"]


def _sketch_sources(
    entries: Sequence[ParamEntry], tensors: Optional[Sequence[Tensor]], source: Source
) -> Sequence[Tensor]:
    """The bound tensors (``"data"``) or their gradients (``"grad"``) to sketch in place."""
    bound = bound_tensors(entries, tensors, "sketch")
    if source == "grad":
        reject_buffers(entries, "sketch(source='grad')")
        absent = [e.name for e, t in zip(entries, bound) if t.grad is None]
        if absent:
            raise ParamMapError(f"missing gradients for {_listed(absent)}; run backward() first")
        return [t.grad for t in bound if t.grad is not None]
    if source != "data":
        raise ParamMapError(f"source must be 'data' or 'grad', not {source!r}")
    return bound


class VectorOps(MapCore):
    """Quantization, shards, sketches and all-reduce of a map's flat vector."""

    def _spans(self) -> list[tuple[str, int, int]]:
        return [(e.name, e.offset, e.numel) for e in self._entries]

    def quantize(
        self, dtype: torch.dtype = torch.int8, scheme: Scheme = "affine", *, source: Source = "data"
    ) -> tuple[Tensor, dict[str, Any]]:
        """Quantize the flat vector with a scale and zero point per parameter.

        Args:
            dtype: ``torch.int8`` or ``torch.uint8``.
            scheme: ``"affine"`` (range widened to include 0, integer zero point) or
                ``"symmetric"`` (zero point 0 for int8, 128 for uint8).
            source: quantize ``"data"`` or ``"grad"``.

        Returns:
            ``(qvec, metadata)``; metadata is a JSON-serialisable dict. The round-trip
            error of each element is at most half its parameter's ``scale``.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> qvec, meta = pmap.quantize(torch.uint8)
            >>> (pmap.dequantize(qvec, meta) - pmap.flatten()).abs().max().item() < 0.01
            True
        """
        try:
            return quantize_flat(
                self.flatten(source), self._spans(), dtype, scheme, self._fingerprint
            )
        except ParamMapError:
            raise
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    def dequantize(self, qvec: Tensor, metadata: dict[str, Any]) -> Tensor:
        """Invert :meth:`quantize`; works on unbound maps too (checked by fingerprint).

        Returns:
            A float vector (the dtype :meth:`flatten` gave) for :meth:`unflatten`.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(3, 2))
            >>> pmap.dequantize(*pmap.quantize()).shape
            torch.Size([8])
        """
        try:
            return dequantize_flat(qvec, metadata, self._spans(), self._fingerprint)
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    # --- shards and sketches -------------------------------------------------------
    def shard(self, rank: int, world_size: int) -> Shard:
        """The contiguous slice of the flat vector that ``rank`` of ``world_size`` owns.

        Rank ``r`` owns ``[r * numel // world_size, (r + 1) * numel // world_size)``;
        together the shards cover the vector exactly once. The shard lists the entries
        it covers (``pieces``, the first and last possibly partial), so optimizer state
        or a checkpoint can be split by rank. Works on unbound maps.

        Raises:
            ParamMapError: on a rank or world size out of range.

        Example:
            >>> shard = ParamMap.from_module(torch.nn.Linear(3, 2)).shard(1, 2)
            >>> shard.start, shard.end, [(p.name, p.start, p.numel) for p in shard.pieces]
            (4, 8, [('weight', 4, 2), ('bias', 0, 2)])
        """
        spans = [(e.name, e.offset, e.numel, e.shape) for e in self._entries]
        try:
            return shard_spans(spans, self._numel, rank, world_size)
        except ValueError as exc:
            raise ParamMapError(str(exc)) from exc

    def sketch(
        self,
        vec: Optional[Tensor],
        k: int,
        seed: int = 0,
        *,
        source: Source = "data",
        density: int = DEFAULT_DENSITY,
    ) -> Tensor:
        """A seeded random projection of a flat vector (or of the mapped tensors) to ``k`` numbers.

        Norms and inner products survive within the bound documented in
        :mod:`gradwatch.vectors.sketch`: the relative error of a norm or an inner
        product exceeds ``eps`` with probability at most ``2 / (k eps^2)``. Sketches are
        linear, so the sketch of an update is the difference of the sketches before and
        after it. Memory is ``O(k + chunk)``: no ``numel x k`` matrix is built.

        Args:
            vec: a flat vector of :attr:`numel` elements, or ``None`` to sketch the bound
                tensors (``source``) in place, without flattening them.
            k: sketch size.
            seed: selects the projection (the same seed gives the same projection on
                every device).
            source: with ``vec=None``, ``"data"`` or ``"grad"``.
            density: non-zeros per element of the projection (see the sketch module).

        Returns:
            A float32 (float64 for float64 data) vector of ``k`` numbers.

        Raises:
            ParamMapError: a vector of the wrong length, or missing gradients.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(300, 100))
            >>> s = pmap.sketch(None, 256)
            >>> 0.5 < (s.norm() / pmap.flatten().norm()).item() < 1.5
            True
        """
        try:
            if vec is None:
                sources = _sketch_sources(self._entries, self._tensors, source)
                return sketch_tensors(sources, k, seed, density=density)
            if not isinstance(vec, Tensor) or vec.dim() != 1 or vec.numel() != self._numel:
                what = tuple(vec.shape) if isinstance(vec, Tensor) else type(vec).__name__
                raise ParamMapError(
                    f"sketch needs a 1-D vector of the map's {self._numel} elements, got {what}"
                )
            return sketch(vec, k, seed, density=density)
        except ParamMapError:
            raise
        except (ValueError, TypeError) as exc:
            raise ParamMapError(f"cannot sketch: {exc}") from exc

    def unsketch(self, sk: Tensor, seed: int = 0, *, density: int = DEFAULT_DENSITY) -> Tensor:
        """The approximate reconstruction ``S^T sk`` of a :meth:`sketch`, a flat vector.

        Unbiased (``E[S^T S x] = x``) with per-element noise of about ``||x|| / sqrt(k)``:
        it shows where a vector's large elements are (pass it to :meth:`locate` or
        :meth:`unflatten`), not the small ones.

        Example:
            >>> pmap = ParamMap.from_module(torch.nn.Linear(300, 100))
            >>> pmap.unsketch(pmap.sketch(None, 64)).shape
            torch.Size([30100])
        """
        try:
            return unsketch(sk, self._numel, seed, density=density, chunk=DEFAULT_CHUNK)
        except (ValueError, TypeError) as exc:
            raise ParamMapError(f"cannot unsketch: {exc}") from exc

    # --- distributed --------------------------------------------------------------------
    def all_reduce_grads(
        self, group: Any = None, average: bool = True, *, missing: Missing = "error"
    ) -> Tensor:
        """Sum (or average) gradients across ranks with one collective, in place.

        One ``all_reduce`` on the flat gradient replaces one per parameter; the result
        is written back into each ``.grad``. Every rank must hold the same layout.

        Args:
            group: process group (default: the world).
            average: divide by the group's size, as DDP does.
            missing: ``"zeros"`` to treat absent gradients as zeros (they get created).

        Returns:
            The reduced flat gradient.

        Raises:
            ParamMapError: if ``torch.distributed`` is not initialized, or as
                :meth:`flatten`/:meth:`unflatten`.

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> pmap.all_reduce_grads()  # doctest: +SKIP
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ParamMapError("all_reduce_grads needs torch.distributed to be initialized")
        vec = self.flatten("grad", missing=missing)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
        if average:
            vec.div_(dist.get_world_size(group))
        self.unflatten(vec, "grad")
        return vec
