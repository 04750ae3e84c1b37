"""The checks, one per module. Adding a check touches its module and :data:`ALL_CHECKS`."""

from __future__ import annotations

from gradwatch.checks.base import Check, LayerSample, RunView, StepView, StructureView
from gradwatch.checks.clipped_while_scaled import ClippedWhileScaled
from gradwatch.checks.coverage import FrozenInOptimizer, NotInOptimizer
from gradwatch.checks.dead import DeadParam
from gradwatch.checks.double_update import DoubleUpdate
from gradwatch.checks.exploding import ExplodingGrad
from gradwatch.checks.frozen_updated import FrozenParamUpdated
from gradwatch.checks.ghost import GhostParam
from gradwatch.checks.loss_disconnected import LossDisconnected
from gradwatch.checks.nonfinite import NonfiniteGrad
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.stale import StaleParam
from gradwatch.checks.step_without_grad import StepWithoutGrad
from gradwatch.checks.unregistered import UnregisteredParam
from gradwatch.checks.vanishing import VanishingGrad
from gradwatch.checks.zero_grad import MissingZeroGrad

__all__ = ["ALL_CHECKS", "Check", "LayerSample", "RunView", "StepView", "StructureView"]

ALL_CHECKS: list[type[Check]] = [
    GhostParam,
    MissingZeroGrad,
    StepWithoutGrad,
    NonfiniteGrad,
    ExplodingGrad,
    VanishingGrad,
    DeadParam,
    StaleParam,
    NotInOptimizer,
    FrozenInOptimizer,
    FrozenParamUpdated,
    NotObserved,
    LossDisconnected,
    DoubleUpdate,
    UnregisteredParam,
    ClippedWhileScaled,
]
