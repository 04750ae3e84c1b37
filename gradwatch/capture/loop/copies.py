"""Copies of a watched module carry nothing of gradwatch's.

A module keeps its forward hooks in its ``__dict__``, so ``copy.deepcopy`` (``AveragedModel``,
EMA copies), pickling (``torch.save(model)``, ``mp.spawn``, spawn-start DataLoaders) would
carry gradwatch's hook objects along: inert, but there, and a pickle that holds them cannot
be loaded with ``torch.load(weights_only=True)`` nor where gradwatch is not installed.

While a model is watched, each class of its modules gets an entry in
:data:`copyreg.dispatch_table`, which ``copy.deepcopy``, :mod:`pickle`, ``torch.save`` and
multiprocessing's pickler consult before ``__reduce_ex__``. The entry reduces the module as
usual and leaves gradwatch's hooks out of the state: the copy has none. It changes nothing
for a module without gradwatch's hooks, and is removed when the last watcher of that class
closes. A class that already has an entry of its own is left alone (its copies fall back to
the inert hooks of :class:`~gradwatch.capture.grads.stamps.ForwardStamp`).

Example:
    >>> cover_class(type(model))  # doctest: +SKIP
    True
    >>> copy.deepcopy(model)._forward_hooks  # doctest: +SKIP
    OrderedDict()
"""

from __future__ import annotations

import copyreg
from collections import OrderedDict
from typing import Any

from torch import nn

__all__ = ["cover_class", "is_gradwatch_hook", "uncover_class"]

# Hook dicts of nn.Module that hold callables, and the dicts keyed by the same handle ids.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_FLAG_DICTS = (
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs",
)
_covered: dict[type, int] = {}  # class -> watchers covering it


def is_gradwatch_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of gradwatch's (a hook object or function of this package)."""
    module = getattr(type(hook), "__module__", "") or ""
    if module.startswith("gradwatch."):
        return True
    return str(getattr(hook, "__module__", "") or "").startswith("gradwatch.")


def _without_hooks(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a module's ``__getstate__``) with gradwatch's hooks left out."""
    dropped: set[Any] = set()
    out = dict(state)
    for attr in _HOOK_DICTS:
        hooks = state.get(attr)
        if not hooks or not any(is_gradwatch_hook(h) for h in hooks.values()):
            continue
        kept: OrderedDict[Any, Any] = OrderedDict()
        for key, hook in hooks.items():
            if is_gradwatch_hook(hook):
                dropped.add(key)
            else:
                kept[key] = hook
        out[attr] = kept
    if dropped:
        for attr in _FLAG_DICTS:
            flags = state.get(attr)
            if flags:
                out[attr] = type(flags)((k, v) for k, v in flags.items() if k not in dropped)
    return out


def _reduce(module: nn.Module) -> Any:
    """The module's usual reduction (``__reduce_ex__``), its state without gradwatch's hooks."""
    rv = module.__reduce_ex__(4)
    if isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
        rv = (*rv[:2], _without_hooks(rv[2]), *rv[3:])
    return rv


def cover_class(cls: type) -> bool:
    """Leave gradwatch's hooks out of copies of ``cls`` instances (``False``: the class has a
    reducer of its own, left alone). Each ``True`` is paired with :func:`uncover_class`."""
    entry = copyreg.dispatch_table.get(cls)
    if entry is None:
        copyreg.dispatch_table[cls] = _reduce
    elif entry is not _reduce:
        return False
    _covered[cls] = _covered.get(cls, 0) + 1
    return True


def uncover_class(cls: type) -> None:
    """One watcher less covers ``cls``; the last one removes the entry."""
    left = _covered.get(cls, 0) - 1
    if left > 0:
        _covered[cls] = left
        return
    _covered.pop(cls, None)
    if copyreg.dispatch_table.get(cls) is _reduce:
        del copyreg.dispatch_table[cls]
