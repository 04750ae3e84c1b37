"""Gradient clipping calls while watching: how many, and which saw no gradient at all.

``torch.nn.utils.clip_grad_norm_`` turns its ``parameters`` into a list, keeps the ones with
a ``.grad``, and hands those to ``torch.nn.utils.clip_grad._get_total_norm``, looked up in
its module at each call. Wrapping that one function sees every ``clip_grad_norm_`` call,
however the user imported it (``from torch.nn.utils import clip_grad_norm_`` too), and
``clip_grad_value_``'s calls are seen where it groups its gradients
(``torch.nn.utils.clip_grad._group_tensors_by_device_and_dtype``, looked up there at each
call and told apart from the norm's own calls by its caller's code): a name bound before
watching (``from torch.nn.utils import clip_grad_value_``) is seen too. A call given an
exhausted generator or a consumed ``filter`` sees no gradient, and clips nothing.

The wrappers are put in place by the first listener and restored by the last (unless
another library wrapped them since); the usual call costs one list-length test. The
user's line is read from the stack only for a call that saw nothing.
"""

from __future__ import annotations

import sys
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


def _value_code() -> Any:
    """The code of torch's ``clip_grad_value_`` under its ``_no_grad`` decorator."""
    fn: Any = _clip.clip_grad_value_
    for _ in range(4):  # decorators that keep ``__wrapped__``, bounded
        fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)


def _wrap() -> None:
    total = _saved["total"] = _clip._get_total_norm
    group = _saved["group"] = _clip._group_tensors_by_device_and_dtype
    value_code = _value_code()

    def _get_total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        n = _count(tensors)
        if n >= 0:
            _tell("clip_grad_norm_", n)
        return total(tensors, *args, **kwargs)

    def _group_tensors_by_device_and_dtype(tensorlists: Any, *args: Any, **kwargs: Any) -> Any:
        # clip_grad_value_ groups its gradients here, looked up in this module at each call:
        # its calls are seen whatever name the user bound it to before watching.
        if sys._getframe(1).f_code is value_code and tensorlists:
            _tell("clip_grad_value_", _count(tensorlists[0]))
        return group(tensorlists, *args, **kwargs)

    for fn in (_get_total_norm, _group_tensors_by_device_and_dtype):
        setattr(fn, "_gradwatch_clip", True)  # noqa: B010 (a mark on a function object)
    _clip._get_total_norm = _get_total_norm  # type: ignore[assignment]
    _clip._group_tensors_by_device_and_dtype = _group_tensors_by_device_and_dtype  # type: ignore[assignment]


def _unwrap() -> None:
    """Put torch's own back, unless another library wrapped ours since (theirs stays)."""
    total, group = _saved.pop("total", None), _saved.pop("group", None)
    if total is not None and getattr(_clip._get_total_norm, "_gradwatch_clip", False):
        _clip._get_total_norm = total  # type: ignore[assignment]
    marked = getattr(_clip._group_tensors_by_device_and_dtype, "_gradwatch_clip", False)
    if group is not None and marked:
        _clip._group_tensors_by_device_and_dtype = group  # type: ignore[assignment]
