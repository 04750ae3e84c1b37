"""A process-wide counter of module/parameter registrations: layout changes without a walk.

Checking whether a model's parameters changed by walking ``model.parameters()`` costs a
Python walk of the module tree on every statistics step. torch calls global registration
hooks whenever any module registers a parameter (``register_parameter``, assigning an
``nn.Parameter`` attribute) or a submodule (``add_module``, assigning a module attribute);
these hooks only bump a counter, and a watcher re-scans its model only when the counter
moved since its last scan. A registration in another model also moves it: that costs one
needless (correct) scan, never a missed change.

The hooks are installed while at least one watcher is open (reference counted).

Example:
    >>> from torch import nn
    >>> acquire()
    >>> before = generation()
    >>> _ = nn.Linear(2, 2)  # registers two parameters
    >>> generation() > before
    True
    >>> release()
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from torch.nn.modules import module as _module

__all__ = ["acquire", "generation", "release"]

_lock = threading.Lock()
_users = 0
_count = 0
_handles: list[Any] = []


def _bump(*_args: Any) -> Optional[Any]:
    global _count
    _count += 1
    return None  # keep the registered value as it is


def generation() -> int:
    """The number of parameter/module registrations seen so far (while any watcher is open)."""
    return _count


def acquire() -> None:
    """Start counting (one call per watcher; pair with :func:`release`)."""
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            _handles.append(_module.register_module_parameter_registration_hook(_bump))
            _handles.append(_module.register_module_module_registration_hook(_bump))


def release() -> None:
    """Stop counting when the last watcher closes."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users == 0:
            for h in _handles:
                h.remove()
            _handles.clear()
