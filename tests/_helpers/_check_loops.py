"""The watched loop the per-check tests in ``tests/checks/`` share.

Every step observed (``every_n_steps: 1``) and gradwatch's own errors raised, so a test sees
each check's verdict on exactly the steps it ran.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from _loops import batches, fired
from torch import nn

import gradwatch

CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise"}

Body = Callable[[int, torch.Tensor, torch.Tensor], None]


def run_steps(
    model: nn.Module,
    opts: Any,
    body: Body,
    steps: int = 4,
    scaler: Optional[torch.amp.GradScaler] = None,
    **cfg: Any,
) -> gradwatch.Report:
    """Runs ``body(k, x, y)`` on ``steps`` seeded batches under ``watch()``; the report."""
    with gradwatch.watch(model, opts, config={**CFG, **cfg}, scaler=scaler) as w:
        for k, (x, y) in enumerate(batches(steps)):
            body(k, x, y)
    return w.report()


def errors_of(report: gradwatch.Report) -> set[str]:
    """The ids of the checks that fired at error level."""
    return fired(report, "error")
