"""A ``with_kwargs`` module hook's arguments, whichever way torch calls it.

``Module._call_impl`` snapshots the hooks, then asks ``hook_id in _forward_hooks_with_kwargs``
per hook: a handle removed by another thread in between (a hook that removes itself after
its first call, while two threads run forwards) is called without ``kwargs``. A hook that
takes ``(module, args, *rest)`` and reads its arguments here accepts both calls.
"""

from __future__ import annotations

from typing import Any

__all__ = ["post_args", "pre_kwargs"]


def pre_kwargs(rest: tuple[Any, ...]) -> dict[str, Any]:
    """A forward pre-hook's ``kwargs``: ``{}`` when torch called it without them."""
    return rest[0] if rest and isinstance(rest[0], dict) else {}


def post_args(rest: tuple[Any, ...]) -> tuple[dict[str, Any], Any]:
    """A forward hook's ``(kwargs, output)``: ``({}, output)`` when called without kwargs."""
    if len(rest) >= 2:
        return rest[0], rest[1]
    return {}, rest[0] if rest else None
