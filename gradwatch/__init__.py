"""gradwatch: find the silent bugs of PyTorch training loops while they train.

Example:
    >>> import gradwatch
    >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
    ...     train_one_epoch()
    >>> watcher.report().raise_for_findings()  # doctest: +SKIP

Names are imported on first use (PEP 562): ``import gradwatch`` alone, as pytest does when it
loads the plugin, does not import torch. It does start keeping ``load_state_dict(strict=False)``
calls (:mod:`gradwatch._loads`: ``nn.Module.load_state_dict`` wrapped, transparently, once
torch is imported), so that a load made before ``watch()`` is judged at its first step;
``GRADWATCH_RECORD_LOADS=0`` turns that off.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradwatch import _loads
from gradwatch._version import __version__
from gradwatch.errors import ConfigError, GhostLayerError, GradWatchError, GradWatchWarning

if TYPE_CHECKING:
    from gradwatch.cli.probe import Probe
    from gradwatch.config import GradWatchConfig
    from gradwatch.core.watcher import Watcher, watch
    from gradwatch.probes import probe
    from gradwatch.report import Coverage, Curvature, Finding, LayerCurvature, LayerStats, Report
    from gradwatch.vectors.parammap import ParamEntry, ParamMap, ParamMapError
    from gradwatch.vectors.sensitivity import SensitivityError, sensitivity

_LAZY = {
    "GradWatchConfig": "gradwatch.config",
    "Coverage": "gradwatch.report",
    "Curvature": "gradwatch.report",
    "LayerCurvature": "gradwatch.report",
    "Finding": "gradwatch.report",
    "LayerStats": "gradwatch.report",
    "Report": "gradwatch.report",
    "Watcher": "gradwatch.core.watcher",
    "watch": "gradwatch.core.watcher",
    "Probe": "gradwatch.cli.probe",
    "probe": "gradwatch.probes",
    "ParamMap": "gradwatch.vectors.parammap",
    "ParamEntry": "gradwatch.vectors.parammap",
    "ParamMapError": "gradwatch.vectors.parammap",
    "sensitivity": "gradwatch.vectors.sensitivity",
    "SensitivityError": "gradwatch.vectors.sensitivity",
}

__all__ = [
    "ConfigError",
    "Coverage",
    "Curvature",
    "Finding",
    "GhostLayerError",
    "GradWatchConfig",
    "GradWatchError",
    "GradWatchWarning",
    "LayerCurvature",
    "LayerStats",
    "ParamEntry",
    "ParamMap",
    "ParamMapError",
    "Probe",
    "Report",
    "SensitivityError",
    "Watcher",
    "__version__",
    "probe",
    "sensitivity",
    "watch",
]


# Hidden from type checkers: a module-level __getattr__ would make every `gradwatch.anything`
# type-check as Any. They see the real names through the TYPE_CHECKING imports above.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_loads.arm()
