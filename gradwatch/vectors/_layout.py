"""The layout behind a :class:`~gradwatch.vectors.parammap.ParamMap`: entries, fingerprint, selection.

Plain data and functions: :mod:`gradwatch.vectors.parammap` builds on them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from gradwatch.model.engines import clean_name
from gradwatch.model.named import NamedModels, check_name

__all__ = ["Kind", "ParamEntry", "ParamMapError", "Patterns"]

Patterns = Union[str, Iterable[str], None]

Kind = Literal["param", "buffer"]
_MAX_LISTED = 10


class ParamMapError(ValueError):
    """A vector, module or document does not match a :class:`ParamMap`."""


@dataclass(frozen=True)
class ParamEntry:
    """One distinct tensor of a :class:`ParamMap`.

    Attributes:
        names: every name the module exposes the tensor under; tied parameters have
            several, the first (in ``named_parameters()`` order) is canonical.
        offset: index of the tensor's first element in the flat vector.
        numel: number of elements.
        shape: the tensor's shape; elements are laid out in row-major order of it,
            whatever the tensor's strides.
        dtype: the tensor's dtype.
        device: the tensor's device when the map was built or bound.
        kind: ``"param"`` or ``"buffer"``.
        requires_grad: whether the tensor required grad when the map was built.

    Example:
        >>> ParamMap.from_module(torch.nn.Linear(3, 2))["bias"].offset
        6
    """

    names: tuple[str, ...]
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    kind: Kind
    requires_grad: bool

    @property
    def name(self) -> str:
        """The canonical (first) name."""
        return self.names[0]

    @property
    def end(self) -> int:
        """One past the index of the tensor's last element in the flat vector."""
        return self.offset + self.numel


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ParamMapError(f"unknown dtype {name!r} in parameter map document")
    return dtype


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        index, rem = divmod(index, size)
        coords.append(rem)
    return tuple(reversed(coords))


def _fingerprint(entries: Sequence[ParamEntry]) -> str:
    # Devices and requires_grad are left out: moving or freezing a model keeps its layout.
    doc = [[list(e.names), list(e.shape), _dtype_name(e.dtype), e.kind] for e in entries]
    digest = hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest}"


def _patterns(what: str, value: Patterns) -> Optional[tuple[str, ...]]:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    try:
        out = tuple(items)
    except TypeError:
        raise ParamMapError(
            f"{what} must be an fnmatch pattern or a list of them, not {type(value).__name__}"
        ) from None
    bad = [p for p in out if not isinstance(p, str) or not p]
    if bad:
        raise ParamMapError(f"{what} patterns must be non-empty strings, got {bad[0]!r}")
    if not out:
        raise ParamMapError(f"{what} is an empty list; pass None to select every parameter")
    return out


def _matches(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(n, p) for n in names for p in patterns)


ModelLike = Union[nn.Module, Mapping[str, nn.Module]]
"""A module, or named models (``{"G": netG, "D": netD}``)."""


def as_module(model: ModelLike) -> nn.Module:
    """``model``, or named models (``{"G": netG, "D": netD}``) as one container whose
    parameters are named ``G:main.0.weight``, as ``gradwatch.watch`` names them."""
    if isinstance(model, nn.Module):
        return model
    if not isinstance(model, Mapping) or not model:
        raise ParamMapError(
            f"expected a torch.nn.Module or a dict of named modules, got {type(model).__name__}"
        )
    for key, m in model.items():
        try:
            check_name(key, "model")
        except ValueError as exc:
            raise ParamMapError(str(exc)) from None
        if not isinstance(m, nn.Module):
            raise ParamMapError(f"model {key!r} is a {type(m).__name__}, not a torch.nn.Module")
    return NamedModels(model)


def _collect(
    module: ModelLike,
    trainable_only: bool,
    include_buffers: bool,
    include: Optional[Sequence[str]] = None,
    exclude: Optional[Sequence[str]] = None,
    *,
    check_patterns: bool = True,
) -> tuple[list[ParamEntry], list[Tensor]]:
    module = as_module(module)
    # named models: "G:.main.0.weight" as "G:main.0.weight"; a plain module's names as they are
    named_models = isinstance(module, NamedModels)
    groups: dict[int, tuple[list[str], Tensor, Kind]] = {}
    named: list[tuple[str, Tensor, Kind]] = [
        (n, p, "param") for n, p in module.named_parameters(remove_duplicate=False)
    ]
    if include_buffers:
        named += [(n, b, "buffer") for n, b in module.named_buffers(remove_duplicate=False)]
    if named_models:
        named = [(clean_name(n), t, kind) for n, t, kind in named]
    for name, tensor, kind in named:
        # Tied tensors are the same object under several names: one entry, all names.
        groups.setdefault(id(tensor), ([], tensor, kind))[0].append(name)
    chosen = [
        (names, t, kind)
        for names, t, kind in groups.values()
        if (include is None or _matches(names, include))
        and not (exclude is not None and _matches(names, exclude))
    ]
    if include is not None and check_patterns:
        _check_include(include, [g for g in groups.values()], trainable_only)
    entries, tensors, offset = [], [], 0
    for names, t, kind in chosen:
        if kind == "param" and trainable_only and not t.requires_grad:
            continue
        if nn.parameter.is_lazy(t):
            raise ParamMapError(
                f"{kind} {names[0]!r} is uninitialized (lazy module); run a forward first"
            )
        shape = tuple(t.shape)
        entries.append(
            ParamEntry(
                tuple(names), offset, t.numel(), shape, t.dtype, t.device, kind, t.requires_grad
            )
        )
        tensors.append(t)
        offset += t.numel()
    return entries, tensors


def _check_include(
    include: Sequence[str], groups: Sequence[tuple[list[str], Tensor, Kind]], trainable_only: bool
) -> None:
    # A pattern that selects nothing is almost always a typo: say so instead of mapping nothing.
    for pattern in include:
        hits = [(names, t, kind) for names, t, kind in groups if _matches(names, [pattern])]
        if not hits:
            raise ParamMapError(f"include pattern {pattern!r} matches no parameter of the module")
        if trainable_only and all(k == "param" and not t.requires_grad for _, t, k in hits):
            raise ParamMapError(
                f"include pattern {pattern!r} matches only frozen parameters (e.g. "
                f"{hits[0][0][0]!r}); pass trainable_only=False to map them"
            )


def entry_to_dict(e: ParamEntry) -> dict[str, Any]:
    """One entry of the JSON map."""
    return {
        "names": list(e.names),
        "offset": e.offset,
        "numel": e.numel,
        "shape": list(e.shape),
        "dtype": _dtype_name(e.dtype),
        "device": str(e.device),
        "kind": e.kind,
        "requires_grad": e.requires_grad,
    }


def entry_from_dict(d: dict[str, Any]) -> ParamEntry:
    """Invert :func:`entry_to_dict` (``KeyError``/``TypeError`` on a malformed entry)."""
    return ParamEntry(
        tuple(str(n) for n in d["names"]),
        int(d["offset"]),
        int(d["numel"]),
        tuple(int(s) for s in d["shape"]),
        _parse_dtype(d["dtype"]),
        torch.device(d["device"]),
        d["kind"],
        bool(d["requires_grad"]),
    )


def layout_diffs(
    map_entries: Sequence[ParamEntry], model_entries: Sequence[ParamEntry]
) -> list[str]:
    """How a model's entries differ from a map's: missing, extra, then per-field, then order."""
    mine = {e.name: e for e in map_entries}
    theirs = {e.name: e for e in model_entries}
    diffs = [f"{n!r} is missing from the model" for n in mine if n not in theirs]
    diffs += [f"the model has an extra {theirs[n].kind} {n!r}" for n in theirs if n not in mine]
    for name, a in mine.items():
        b = theirs.get(name)
        if b is None:
            continue
        for field in ("names", "shape", "dtype", "kind"):
            va, vb = getattr(a, field), getattr(b, field)
            if va != vb:
                fmt = _dtype_name if field == "dtype" else list
                diffs.append(f"{name!r}: {field} {fmt(va)} in the map, {fmt(vb)} in the model")
    common = [n for n in mine if n in theirs]
    if common != [n for n in theirs if n in mine]:
        diffs.append("the entries are in a different order")
    return diffs
