"""Where the watched model's mode was changed: the line that called ``eval()``.

While a watcher needs it, ``nn.Module.train`` is wrapped (one wrapper for every watcher,
restored when the last one closes). ``eval()`` is ``self.train(False)``, a subclass's
``train()`` override ends in ``super().train(mode)``, and ``train()`` recurses through the
children: every mode change of a module goes through the wrapper. For a module no watcher
holds it costs one set lookup per watcher; for a watched one it records the calling line
(the first frame outside gradwatch and torch, found once per outermost call). No attribute
is set on the model: ``copy.deepcopy`` and pickles of it carry nothing of gradwatch's.

Example:
    >>> calls = ModeCalls(); calls.watch(model)  # doctest: +SKIP
    >>> model.eval(); calls.eval_site(model)  # doctest: +SKIP
    'train.py:88'
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from torch import nn

from gradwatch.model.locations import call_site

__all__ = ["ModeCalls"]

_original: Optional[Callable[..., Any]] = None
_listeners: list[weakref.ref[ModeCalls]] = []
_call: list[Any] = [0, None]  # depth of nested train() calls, the outermost call's line


def _train(self: nn.Module, mode: bool = True) -> Any:
    _call[0] += 1
    for ref in _listeners:
        me = ref()
        if me is not None and id(self) in me.modules:
            try:
                if _call[1] is None:
                    _call[1] = call_site() or ""
                me.sites[id(self)] = None if mode else _call[1]
            except Exception as exc:  # never the user's train(); the fault is still seen
                me.fault(exc)
    try:
        assert _original is not None
        return _original(self, mode)
    finally:
        _call[0] -= 1
        if _call[0] == 0:
            _call[1] = None


class ModeCalls:
    """The line of the latest ``train(False)`` of each watched module still in eval."""

    def __init__(self) -> None:
        self.modules: set[int] = set()
        self.sites: dict[int, Optional[str]] = {}
        self._on = False
        # the run's fault funnel (``Faults.callback()``), set by the source that owns this
        self.on_error: Optional[Callable[[str, BaseException], None]] = None

    def fault(self, exc: BaseException) -> None:
        """A fault while noting a ``train()`` call: an ``internal_error``, never the user's."""
        if self.on_error is not None:
            self.on_error("mode calls", exc)

    def watch(self, model: nn.Module) -> None:
        """Follow the modules of ``model`` (again at each layout sync)."""
        global _original
        self.modules = {id(m) for m in model.modules()}
        if self._on:
            return
        self._on = True
        if _original is None:  # in place already (maybe under another library's wrapper)
            _original = nn.Module.train
            nn.Module.train = _train  # type: ignore[method-assign,assignment]
        _listeners.append(weakref.ref(self))

    def eval_site(self, module: Optional[nn.Module]) -> Optional[str]:
        """Where ``module`` was put in eval mode, when gradwatch saw it (``None``: unknown)."""
        return self.sites.get(id(module)) or None if module is not None else None

    def remove(self) -> None:
        global _original
        _listeners[:] = [r for r in _listeners if r() is not None and r() is not self]
        self._on = False
        self.modules = set()
        if not _listeners and _original is not None and nn.Module.train is _train:
            nn.Module.train = _original  # type: ignore[method-assign]
            _original = None
