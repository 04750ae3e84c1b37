"""The checks, one per module. Adding a check touches its module and :data:`ALL_CHECKS`."""

from __future__ import annotations

from gradwatch.checks.base import Check
from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.checks.views import LayerSample, RunView, StepView, StructureView

__all__ = ["ALL_CHECKS", "Check", "LayerSample", "RunView", "StepView", "StructureView"]
