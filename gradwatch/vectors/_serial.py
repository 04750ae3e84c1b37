"""The JSON document of a :class:`~gradwatch.vectors.parammap.ParamMap`, and binding a model to it.

Plain functions over entries and options: :mod:`gradwatch.vectors.parammap` wraps them
in ``to_dict``/``from_dict``/``to_json``/``from_json``/``check_compatible``/``bind``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol, TypeVar

import torch
from torch import Tensor

from gradwatch.vectors._layout import (
    ModelLike,
    ParamEntry,
    ParamMapError,
    _collect,
    _dtype_name,
    _fingerprint,
    entry_from_dict,
    entry_to_dict,
    layout_diffs,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Options",
    "bind_model",
    "layout_differences",
    "map_from_dict",
    "map_to_dict",
    "parse_json",
]

FORMAT = "gradwatch.vectors.parammap"
FORMAT_VERSION = 1

#: ``(trainable_only, include_buffers, include, exclude)``, the order ``_collect`` takes.
Options = tuple[bool, bool, Optional[tuple[str, ...]], Optional[tuple[str, ...]]]


class _Built(Protocol):
    @property
    def fingerprint(self) -> str: ...

    @property
    def numel(self) -> int: ...


_M = TypeVar("_M", bound=_Built)


def map_to_dict(
    entries: Sequence[ParamEntry],
    fingerprint: str,
    flat_dtype: torch.dtype,
    options: Options,
) -> dict[str, Any]:
    """The document of a map with these entries, fingerprint, flat dtype and options."""
    trainable_only, include_buffers, include, exclude = options
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "numel": sum(e.numel for e in entries),
        "flat_dtype": _dtype_name(flat_dtype),
        "offsets_in": "elements",
        "trainable_only": trainable_only,
        "include_buffers": include_buffers,
        "include": None if include is None else list(include),
        "exclude": None if exclude is None else list(exclude),
        "entries": [entry_to_dict(e) for e in entries],
    }


def map_from_dict(build: Callable[..., _M], doc: dict[str, Any]) -> _M:
    """Check ``doc``'s header, build the map with ``build(entries, **options)``, verify it.

    ``build`` is the map class; the built map's ``fingerprint`` and ``numel`` must match
    the ones the document records.

    Raises:
        ParamMapError: another format or version, a malformed or a corrupt document.
    """
    try:
        if doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
            raise ParamMapError(
                f"not a gradwatch parameter map v{FORMAT_VERSION} (format {doc.get('format')!r}, version {doc.get('version')!r})"
            )
        pmap = build(
            [entry_from_dict(d) for d in doc["entries"]],
            trainable_only=bool(doc["trainable_only"]),
            include_buffers=bool(doc["include_buffers"]),
            include=doc.get("include"),
            exclude=doc.get("exclude"),
        )
    except (KeyError, TypeError, RuntimeError, AttributeError) as exc:
        raise ParamMapError(f"malformed parameter map document: {exc!r}") from exc
    if doc.get("fingerprint") != pmap.fingerprint or doc.get("numel") != pmap.numel:
        raise ParamMapError(
            "parameter map document is corrupt: fingerprint or numel does not match its entries"
        )
    return pmap


def parse_json(text: str | bytes) -> dict[str, Any]:
    """The JSON object in ``text``.

    Raises:
        ParamMapError: invalid JSON, or JSON that is not an object.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParamMapError(f"parameter map is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ParamMapError("parameter map document must be a JSON object")
    return doc


def layout_differences(
    entries: Sequence[ParamEntry], fingerprint: str, model: ModelLike, options: Options
) -> list[str]:
    """How ``model``, mapped with ``options``, differs from ``entries`` (empty when it does not).

    Devices do not count: the fingerprint covers names, shapes, dtypes and kinds only.
    """
    model_entries = _collect(model, *options, check_patterns=False)[0]
    if _fingerprint(model_entries) == fingerprint:
        return []
    return layout_diffs(entries, model_entries)


def bind_model(
    entries: Sequence[ParamEntry], fingerprint: str, model: ModelLike, options: Options
) -> tuple[list[ParamEntry], list[Tensor]]:
    """``model``'s entries (devices and ``requires_grad`` refreshed) and tensors, checked first.

    Raises:
        ParamMapError: one line naming the first difference (and how many more).
    """
    diffs = layout_differences(entries, fingerprint, model, options)
    if diffs:
        more = f" (and {len(diffs) - 1} more differences)" if len(diffs) > 1 else ""
        raise ParamMapError(f"model does not match the map: {diffs[0]}{more}")
    return _collect(model, *options, check_patterns=False)
