"""The watching core: hooks record evidence, the pipeline turns it into step views.

Data flow: ``hooks`` (install/trim/remove) → ``evidence`` (what arrived, when, in which grad
mode) → ``pipeline`` (one step's gradients gathered, one host transfer) → a
:class:`~gradwatch.checks.StepView` judged by :mod:`gradwatch.checks` → ``findings`` →
``build_report`` → :class:`~gradwatch.Report`. :class:`Watcher` is the lifecycle facade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.core.watcher import Watcher, watch

__all__ = ["Watcher", "watch"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the checks import core helpers (core.stats), and an eager import
    # of the watcher here would import the checks back while they are half initialised.
    if name in __all__:
        from gradwatch.core import watcher

        return getattr(watcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
