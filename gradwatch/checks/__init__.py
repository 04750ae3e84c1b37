"""The checks, one per module. Adding a check touches its module and :data:`ALL_CHECKS`."""

from __future__ import annotations

from gradwatch.checks.base import Check, LayerSample, RunView, StepView, StructureView
from gradwatch.checks.registry import ALL_CHECKS

__all__ = ["ALL_CHECKS", "Check", "LayerSample", "RunView", "StepView", "StructureView"]
