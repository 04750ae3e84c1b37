"""Pydantic validation errors turned into one line that names file, field and allowed values."""

from __future__ import annotations

import typing
from typing import Any, Optional

from pydantic import BaseModel, ValidationError


def _submodel(model: type[BaseModel], loc: tuple[Any, ...]) -> Optional[type[BaseModel]]:
    """The model class that owns the last key of ``loc`` (for listing allowed keys)."""
    current: Any = model
    for key in loc[:-1]:
        field = getattr(current, "model_fields", {}).get(key)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *typing.get_args(ann)]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def clip(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was (errors echo user input)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def show(value: Any, limit: int = 120) -> str:
    """A bounded ``repr`` of a user's value, safe for any size (``repr`` of a 5000-digit int
    raises)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    try:
        return clip(repr(value), limit)
    except ValueError:
        return f"<{type(value).__name__} too large to show>"


def format_validation_error(exc: ValidationError, model: type[BaseModel], *, source: str) -> str:
    """One line: ``source: field.path: problem (got value); allowed: ...``."""
    parts = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        field = ".".join(str(p) for p in loc) or "(top level)"
        msg = err.get("msg", "invalid value")
        if err.get("type") == "extra_forbidden":
            owner = _submodel(model, loc)
            allowed = ", ".join(owner.model_fields) if owner else ""
            parts.append(
                f"unknown key {show(field)}" + (f" (allowed: {allowed})" if allowed else "")
            )
            continue
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {show(got)})"
        parts.append(f"{clip(field)}: {clip(msg)}{shown}")
    return f"{source}: " + "; ".join(parts)
