"""Gradient clipping calls while watching: how many, and which saw no gradient at all.

``torch.nn.utils.clip_grad_norm_`` turns its ``parameters`` into a list, keeps the ones with
a ``.grad``, and hands those to ``torch.nn.utils.clip_grad._get_total_norm``, looked up in
its module at each call. Wrapping that one function sees every ``clip_grad_norm_`` call,
however the user imported it (``from torch.nn.utils import clip_grad_norm_`` too), and
``clip_grad_value_`` is wrapped where it is looked up (``torch.nn.utils``). A call given an
exhausted generator or a consumed ``filter`` sees no gradient, and clips nothing.

The wrappers are put in place by the first listener and restored by the last (unless
another library wrapped them since); the usual call costs one list-length test. The
user's line is read from the stack only for a call that saw nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch.nn.utils
import torch.nn.utils.clip_grad as _clip

from gradwatch.model.locations import call_site

__all__ = ["ClipCalls"]

_listeners: list[weakref.ref[ClipCalls]] = []
_saved: dict[str, Callable[..., Any]] = {}


class ClipCalls:
    """One watcher's view of the clipping calls (see the module docstring)."""

    def __init__(self) -> None:
        self.calls = 0
        self.empty: list[tuple[str, Optional[str]]] = []  # (function, the user's line)
        self._on = False

    def install(self) -> None:
        if self._on:
            return
        self._on = True
        if not _listeners:
            _wrap()
        _listeners.append(weakref.ref(self))

    def take(self) -> tuple[int, list[tuple[str, Optional[str]]]]:
        """The calls since the last take, and those that saw no gradient."""
        out = (self.calls, self.empty)
        self.calls, self.empty = 0, []
        return out

    def remove(self) -> None:
        if not self._on:
            return
        self._on = False
        _listeners[:] = [r for r in _listeners if r() is not None and r() is not self]
        if not _listeners:
            _unwrap()


def _tell(function: str, saw: int) -> None:
    line = call_site() if saw == 0 else None  # the user's line (past torch and gradwatch)
    for ref in list(_listeners):
        me = ref()
        if me is not None:
            me.calls += 1
            if saw == 0:
                me.empty.append((function, line))


def _count(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return 1
    try:
        return len(tensors)
    except TypeError:
        return -1  # an iterable it cannot size without consuming it: not judged


def _grads(parameters: Any) -> int:
    if isinstance(parameters, torch.Tensor):
        return int(parameters.grad is not None)
    return sum(1 for p in parameters if getattr(p, "grad", None) is not None)


def _wrap() -> None:
    total = _saved["total"] = _clip._get_total_norm
    value = _saved["value"] = torch.nn.utils.clip_grad_value_

    def _get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        n = _count(tensors)
        if n >= 0:
            _tell("clip_grad_norm_", n)
        return total(tensors, *args, **kwargs)

    def clip_grad_value_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # as torch does: a generator is read once
        _tell("clip_grad_value_", _grads(parameters))
        return value(parameters, *args, **kwargs)

    for fn in (_get_total_norm, clip_grad_value_):
        setattr(fn, "_gradwatch_clip", True)  # noqa: B010 (a mark on a function object)
    _clip._get_total_norm = _get_total_norm  # type: ignore[assignment]
    torch.nn.utils.clip_grad_value_ = clip_grad_value_


def _unwrap() -> None:
    """Put torch's own back, unless another library wrapped ours since (theirs stays)."""
    total, value = _saved.pop("total", None), _saved.pop("value", None)
    if total is not None and getattr(_clip._get_total_norm, "_gradwatch_clip", False):
        _clip._get_total_norm = total  # type: ignore[assignment]
    if value is not None and getattr(torch.nn.utils.clip_grad_value_, "_gradwatch_clip", False):
        torch.nn.utils.clip_grad_value_ = value
