"""Forward hooks that stay with their module: a copy or a pickle of it carries none.

:class:`ForwardStamp` wraps each forward hook gradwatch puts on a layer; a one-shot
recorder names the line that calls a flagged module (:func:`caller_recorder`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

from torch import nn

from gradwatch.model.locations import call_site

__all__ = ["ForwardStamp", "caller_recorder"]


class ForwardStamp:
    """A layer's forward hook that stays with the module it was put on.

    Modules keep their hooks in their ``__dict__``, so ``copy.deepcopy`` (``AveragedModel``,
    EMA copies) and pickling (``torch.save(model)``, ``mp.spawn``, spawn-start DataLoaders)
    would carry it along. A copy gets a :class:`_Detached` hook that removes itself at its
    first call; a pickle gets a no-op from the standard library, so it loads where gradwatch
    is not installed. A call from another module (a shallow copy) records nothing.
    """

    __slots__ = ("__weakref__", "fn", "owner")

    def __init__(self, fn: Callable[..., None], module: nn.Module) -> None:
        self.fn = fn
        self.owner = weakref.ref(module)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if module is self.owner():
            self.fn(module, args, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Detached:
        return _Detached()

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT_REDUCE


class _Detached:
    """What a deep copy of a watched module holds: leaves the copy's hooks at its first call."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        hooks = module._forward_hooks
        for key in [k for k, h in hooks.items() if h is self]:
            del hooks[key]

    def __reduce__(self) -> tuple[Any, ...]:
        return _INERT_REDUCE


# ``sys.audit("...", module, args, output)`` returns None and does nothing unless an audit
# hook listens: a picklable no-op that needs nothing but the standard library to load.
_INERT_REDUCE = (functools.partial, (sys.audit, "gradwatch.detached_forward_hook"))


def caller_recorder(
    tracker: Any, callers: dict[str, Any], name: str, on_error: Callable[[str, BaseException], None]
) -> Callable[..., None]:
    """A one-shot forward hook: the line that called module ``name``, then it removes itself."""

    def record(module: nn.Module, args: Any, output: Any) -> None:
        try:
            site = call_site()
            if site is not None:
                tracker.called_at[name] = site
            tracker.want_call.discard(name)
            handle = callers.get(name)
            if handle is not None:
                handle.remove()
        except Exception as exc:
            on_error("forward hook", exc)

    return record
