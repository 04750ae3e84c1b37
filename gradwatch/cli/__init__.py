"""The ``gradwatch`` command line and the :class:`~gradwatch.Probe` it runs."""

from __future__ import annotations

from gradwatch.cli.main import main

__all__ = ["main"]
