"""Flattening over a :class:`~gradwatch.vectors.parammap.ParamMap`'s entries, as plain functions.

Each function takes the map's entries (and, where it reads or writes memory, the bound
tensors in the same order) and checks everything before it copies anything, so an error
leaves the model untouched. :mod:`gradwatch.vectors.parammap` wraps them in methods.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Sequence
from typing import Literal, Optional, SupportsIndex

import torch
from torch import Tensor

from gradwatch.vectors._layout import ParamEntry, ParamMapError, _dtype_name, _listed, _unravel

__all__ = [
    "Missing",
    "Source",
    "bound_tensors",
    "check_entries",
    "flatten_tensors",
    "locate_index",
    "promoted_dtype",
    "reject_buffers",
    "unflatten_into",
]

Source = Literal["data", "grad"]
Missing = Literal["error", "zeros"]


def check_entries(entries: Sequence[ParamEntry]) -> tuple[dict[str, int], int]:
    """Check that ``entries`` tile the flat vector from 0; return ``(index by name, numel)``.

    Raises:
        ParamMapError: if offsets, sizes, kinds or names are inconsistent.
    """
    offset = 0
    by_name: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.offset != offset or e.numel != math.prod(e.shape) or e.numel < 0:
            raise ParamMapError(
                f"entry {e.name!r} has offset {e.offset}/numel {e.numel}, expected {offset}/{math.prod(e.shape)}"
            )
        if e.kind not in ("param", "buffer") or not e.names:
            raise ParamMapError(f"entry {i} has kind {e.kind!r} and names {e.names!r}")
        for n in e.names:
            if by_name.setdefault(n, i) != i:
                raise ParamMapError(f"name {n!r} appears in two entries")
        offset += e.numel
    return by_name, offset


def promoted_dtype(entries: Sequence[ParamEntry]) -> torch.dtype:
    """All entry dtypes promoted together (``float32`` for no entries)."""
    dtypes = [e.dtype for e in entries] or [torch.float32]
    return functools.reduce(torch.promote_types, dtypes)


def bound_tensors(
    entries: Sequence[ParamEntry], tensors: Optional[Sequence[Tensor]], what: str
) -> tuple[Tensor, ...]:
    """The bound tensors, checked to still have the shapes and dtypes of ``entries``.

    Raises:
        ParamMapError: on an unbound map (``tensors`` is ``None``) or a tensor whose shape
            or dtype changed since the map was built; ``what`` names the operation.
    """
    if tensors is None:
        raise ParamMapError(
            f"{what} needs tensors: this map was loaded from JSON; call bind(model) first"
        )
    for e, t in zip(entries, tensors):
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise ParamMapError(
                f"{e.kind} {e.name!r} changed from {_dtype_name(e.dtype)}{list(e.shape)} to "
                f"{_dtype_name(t.dtype)}{list(t.shape)} since the map was built; build a new map"
            )
    return tuple(tensors)


def reject_buffers(entries: Sequence[ParamEntry], what: str) -> None:
    """Raise :class:`ParamMapError` when ``entries`` include buffers (they have no gradient)."""
    buffers = [e.name for e in entries if e.kind == "buffer"]
    if buffers:
        raise ParamMapError(
            f"{what} needs parameters only, but the map has buffers {_listed(buffers)}; build it with include_buffers=False"
        )


def _reject_meta(entries: Sequence[ParamEntry], tensors: Sequence[Tensor]) -> None:
    for e, t in zip(entries, tensors):
        if t.device.type == "meta":
            raise ParamMapError(f"{e.kind} {e.name!r} is on the meta device and holds no data")


def flatten_tensors(
    entries: Sequence[ParamEntry],
    tensors: Optional[Sequence[Tensor]],
    source: Source = "data",
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
    *,
    missing: Missing = "error",
) -> Tensor:
    """Copy ``tensors`` (or their gradients) into one new 1-D vector laid out as ``entries``.

    See :meth:`ParamMap.flatten <gradwatch.vectors.parammap.ParamMap.flatten>` for the
    arguments; ``tensors`` is ``None`` for an unbound map (an error).
    """
    if source not in ("data", "grad"):
        raise ParamMapError(f"source must be 'data' or 'grad', not {source!r}")
    if missing not in ("error", "zeros"):
        raise ParamMapError(f"missing must be 'error' or 'zeros', not {missing!r}")
    tensors = bound_tensors(entries, tensors, "flatten")
    _reject_meta(entries, tensors)
    if source == "grad":
        reject_buffers(entries, "flatten(source='grad')")
        pieces: list[Optional[Tensor]] = [t.grad for t in tensors]
        absent = [e.name for e, g in zip(entries, pieces) if g is None]
        if absent and missing == "error":
            raise ParamMapError(
                f"missing gradients for {_listed(absent)}; run backward() first or pass missing='zeros'"
            )
    else:
        pieces = [t.detach() for t in tensors]
    out_dtype = dtype if dtype is not None else promoted_dtype(entries)
    if device is None:
        devices = list(dict.fromkeys(t.device for t in tensors))
        if len(devices) > 1:
            raise ParamMapError(
                f"tensors are on several devices ({', '.join(map(str, devices))}); pass device="
            )
        device = devices[0] if devices else torch.device("cpu")
    if not pieces:
        return torch.empty(0, dtype=out_dtype, device=device)
    flat = [
        torch.zeros(e.numel, dtype=out_dtype, device=device)
        if p is None
        else (p.to_dense() if p.layout != torch.strided else p).reshape(-1).to(device, out_dtype)
        for e, p in zip(entries, pieces)
    ]
    return torch.cat(flat)


def _check_vector(
    entries: Sequence[ParamEntry], tensors: Sequence[Tensor], vec: Tensor, numel: int
) -> None:
    """Check that ``vec`` fits ``entries`` exactly and can be written into every tensor."""
    n = vec.numel()
    if n < numel:
        e = next(e for e in entries if e.end > n)
        raise ParamMapError(
            f"vector has {n} elements, the map needs {numel}: {e.kind} {e.name!r} "
            f"(elements {e.offset}..{e.end - 1}) does not fit"
        )
    if n > numel:
        last = f"the last entry {entries[-1].name!r}" if entries else "an empty map"
        raise ParamMapError(
            f"vector has {n} elements, the map needs {numel}: {n - numel} extra after {last}"
        )
    for e, t in zip(entries, tensors):
        if vec.device != t.device:
            raise ParamMapError(
                f"vector is on {vec.device} but {e.kind} {e.name!r} is on {t.device}"
            )
        if t.device.type == "meta":
            raise ParamMapError(f"{e.kind} {e.name!r} is on the meta device and holds no data")
        if torch.promote_types(vec.dtype, t.dtype) != vec.dtype:
            raise ParamMapError(
                f"a {_dtype_name(vec.dtype)} vector cannot hold {e.kind} {e.name!r} "
                f"({_dtype_name(t.dtype)}) without loss; flatten with a wider dtype"
            )


def unflatten_into(
    entries: Sequence[ParamEntry],
    tensors: Optional[Sequence[Tensor]],
    vec: Tensor,
    target: Source = "data",
) -> None:
    """Write ``vec`` into ``tensors`` (or their ``.grad``) in place, all checks first.

    See :meth:`ParamMap.unflatten <gradwatch.vectors.parammap.ParamMap.unflatten>` for
    the rules; ``tensors`` is ``None`` for an unbound map (an error).
    """
    if target not in ("data", "grad"):
        raise ParamMapError(f"target must be 'data' or 'grad', not {target!r}")
    tensors = bound_tensors(entries, tensors, "unflatten")
    if not isinstance(vec, Tensor) or vec.dim() != 1 or vec.layout != torch.strided:
        what = f"shape {tuple(vec.shape)}" if isinstance(vec, Tensor) else type(vec).__name__
        raise ParamMapError(f"unflatten needs a dense 1-D tensor, got {what}")
    if target == "grad":
        reject_buffers(entries, "unflatten(target='grad')")
    _check_vector(entries, tensors, vec, sum(e.numel for e in entries))
    with torch.no_grad():
        for e, t, chunk in zip(entries, tensors, vec.split([e.numel for e in entries])):
            src = chunk.view(e.shape)
            if target == "data":
                t.copy_(src)
            elif t.grad is None or t.grad.layout != torch.strided:
                grad = torch.empty_like(t)  # keeps the parameter's strides
                grad.copy_(src)
                t.grad = grad
            else:
                t.grad.copy_(src)


def locate_index(
    entries: Sequence[ParamEntry], offsets: Sequence[int], numel: int, index: SupportsIndex
) -> tuple[str, tuple[int, ...]]:
    """``(canonical name, coords)`` of flat ``index``; ``offsets`` are the entries' offsets.

    Raises:
        ParamMapError: if ``index`` is outside ``[0, numel)``.
    """
    i = operator.index(index)
    if not 0 <= i < numel:
        raise ParamMapError(f"flat index {i} is outside the map's {numel} elements")
    e = entries[bisect.bisect_right(offsets, i) - 1]
    return e.name, _unravel(i - e.offset, e.shape)
