"""gradwatch: find the silent bugs of PyTorch training loops while they train.

Example:
    >>> import gradwatch
    >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
    ...     train_one_epoch()
    >>> watcher.report().raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

from gradwatch._version import __version__
from gradwatch.config import GradWatchConfig
from gradwatch.errors import ConfigError, GhostLayerError, GradWatchError, GradWatchWarning
from gradwatch.probe import Probe
from gradwatch.report import Coverage, Finding, LayerStats, Report
from gradwatch.watcher import Watcher, watch

__all__ = [
    "ConfigError",
    "Coverage",
    "Finding",
    "GhostLayerError",
    "GradWatchConfig",
    "GradWatchError",
    "GradWatchWarning",
    "LayerStats",
    "Probe",
    "Report",
    "Watcher",
    "__version__",
    "watch",
]
