"""The registry: every check gradwatch runs, in order, and what follows from their classes.

Adding a check touches its module and :data:`ALL_CHECKS`; the config
(:class:`gradwatch.config.ChecksConfig`) and ``gradwatch explain`` are built from this list.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradwatch.checks.autocast_bypassed import AutocastBypassed
from gradwatch.checks.base import Check
from gradwatch.checks.batch_order_dependent import BatchOrderDependent
from gradwatch.checks.batch_repeated import BatchRepeated
from gradwatch.checks.batch_single_class import BatchSingleClass
from gradwatch.checks.call_without_effect import CallWithoutEffect
from gradwatch.checks.clip_after_step import ClipAfterStep
from gradwatch.checks.clip_without_effect import ClipWithoutEffect
from gradwatch.checks.clipped_while_scaled import ClippedWhileScaled
from gradwatch.checks.coverage import FrozenInOptimizer, NotInOptimizer
from gradwatch.checks.dead import DeadParam
from gradwatch.checks.decay_excluded import DecayOnExcludedParams
from gradwatch.checks.dependence_outside_receptive_field import DependenceOutsideReceptiveField
from gradwatch.checks.does_not_learn import DoesNotLearn
from gradwatch.checks.double_backward import DoubleBackward
from gradwatch.checks.double_update import DoubleUpdate
from gradwatch.checks.eval_mode import EvalModeTraining
from gradwatch.checks.eval_on_trained import EvalOnTrainedSamples
from gradwatch.checks.eval_stochastic import EvalForwardStochastic
from gradwatch.checks.exploding import ExplodingGrad
from gradwatch.checks.forward_not_reproducible import ForwardNotReproducible
from gradwatch.checks.freeze_flag import FreezeNotApplied
from gradwatch.checks.frozen_stats import FrozenStatsUpdated
from gradwatch.checks.frozen_updated import FrozenParamUpdated
from gradwatch.checks.ghost import GhostParam
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.checks.graph_retained import GraphRetainedAcrossSteps
from gradwatch.checks.inputs_unscaled import InputsUnscaled
from gradwatch.checks.internal_error import InternalError
from gradwatch.checks.loss_broadcast import LossBroadcast
from gradwatch.checks.loss_disconnected import LossDisconnected
from gradwatch.checks.loss_domain import LossInputOutOfDomain
from gradwatch.checks.loss_normalised import LossInputAlreadyNormalised
from gradwatch.checks.loss_term_dominates import LossTermDominates
from gradwatch.checks.nonfinite import NonfiniteGrad
from gradwatch.checks.nonfinite_param import NonfiniteParam
from gradwatch.checks.normalised_over_batch import NormalisedOverBatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.optimizer_hparams import OptimizerHparamsDegenerate
from gradwatch.checks.outside_model import ParamOutsideModel
from gradwatch.checks.replica_divergence import ReplicaDivergence
from gradwatch.checks.resume_mismatch import ResumeMismatch
from gradwatch.checks.sample_dependence import SampleDependence
from gradwatch.checks.sample_weight_split import SampleWeightDependsOnSplit
from gradwatch.checks.scheduler_misstepped import SchedulerMisstepped
from gradwatch.checks.shared_module import SharedModule
from gradwatch.checks.stale import StaleParam
from gradwatch.checks.step_without_grad import StepWithoutGrad
from gradwatch.checks.symmetric_units import SymmetricUnits
from gradwatch.checks.tie_broken import TieBroken
from gradwatch.checks.unregistered import UnregisteredParam
from gradwatch.checks.update_ascends_loss import UpdateAscendsLoss
from gradwatch.checks.vanishing import VanishingGrad
from gradwatch.checks.zero_grad import MissingZeroGrad
from gradwatch.errors import GradWatchError

__all__ = ["ALL_CHECKS", "SELF_CHECKS", "by_id", "error_class", "preview_ids"]

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
    ClipAfterStep,
    SchedulerMisstepped,
    DoubleBackward,
    NonfiniteParam,
    EvalModeTraining,
    FrozenStatsUpdated,
    FreezeNotApplied,
    ResumeMismatch,
    ReplicaDivergence,
    AutocastBypassed,
    SharedModule,
    TieBroken,
    SymmetricUnits,
    OptimizerHparamsDegenerate,
    DecayOnExcludedParams,
    ClipWithoutEffect,
    GradientMismatch,
    SampleDependence,
    DoesNotLearn,
    LossInputAlreadyNormalised,
    LossBroadcast,
    GraphRetainedAcrossSteps,
    NormalisedOverBatch,
    EvalForwardStochastic,
    LossTermDominates,
    ForwardNotReproducible,
    BatchOrderDependent,
    DependenceOutsideReceptiveField,
    LossInputOutOfDomain,
    CallWithoutEffect,
    BatchRepeated,
    EvalOnTrainedSamples,
    BatchSingleClass,
    InputsUnscaled,
    UpdateAscendsLoss,
    SampleWeightDependsOnSplit,
]

# gradwatch's own: always on, in no config (a fault or a synthesized name must be said).
SELF_CHECKS: list[type[Check]] = [InternalError, ParamOutsideModel]


def by_id(check_id: str) -> type[Check]:
    """The check class of ``check_id`` (``KeyError`` when there is none)."""
    for cls in [*ALL_CHECKS, *SELF_CHECKS]:
        if cls.id == check_id:
            return cls
    raise KeyError(check_id)


def preview_ids() -> frozenset[str]:
    """The ids of the checks in preview (each check's ``maturity``, stated in its class)."""
    return frozenset(cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS] if cls.maturity == "preview")


def error_class(check_ids: Iterable[str]) -> type[GradWatchError]:
    """The exception for failing findings of these checks: the first specific one, if any."""
    for check_id in check_ids:
        for cls in ALL_CHECKS:
            if cls.id == check_id and cls.error is not GradWatchError:
                return cls.error
    return GradWatchError
