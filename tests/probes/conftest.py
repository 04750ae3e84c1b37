"""Probe tests run tiny models on one thread (see ``_threads``)."""

from __future__ import annotations

from _threads import one_thread

__all__ = ["one_thread"]
