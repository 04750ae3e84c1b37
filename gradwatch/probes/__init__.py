"""Probes: test the training step itself, on a copy of the model, before it costs a run.

Each probe is an experiment a careful practitioner runs by hand on a new setup (A. Karpathy,
"A Recipe for Training Neural Networks", 2019), here on a deep copy of the model inside
:func:`~gradwatch.probes._sandbox.rng_kept`: the user's weights, optimizer state, global RNG
state and data are never touched. ``gradient_mismatch`` checks the derivative numerically,
``sample_dependence`` charts which samples an output depends on, ``does_not_learn``
overfits one batch, ``update_ascends_loss`` checks that one step of the user's optimizer
descends, ``sample_weight_depends_on_split`` weighs the batch's halves in its gradient;
three properties of every correct model need no loss
(``forward_not_reproducible``, ``batch_order_dependent``,
``dependence_outside_receptive_field``: :data:`LOSS_FREE_PROBES`). Each has a time budget
(its config's ``budget_s``); a probe that cannot
judge says so as an ``info`` ``not_observed`` finding and ``verdict: not_observed`` in the
report's ``probes`` section, never as a pass.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> batch = (torch.randn(8, 4), torch.randn(8, 1))
    >>> report = probe(model, batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    >>> [(p.id, p.verdict) for p in report.probes]
    [('sample_dependence', 'passed'), ('gradient_mismatch', 'passed'), ('does_not_learn', 'passed'), \
('forward_not_reproducible', 'passed'), ('batch_order_dependent', 'passed'), \
('dependence_outside_receptive_field', 'not_observed'), ('update_ascends_loss', 'not_observed'), \
('sample_weight_depends_on_split', 'passed')]
"""

from __future__ import annotations

import fnmatch
import time
import warnings
from collections.abc import Collection
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from gradwatch._severity import at_least
from gradwatch._version import __version__
from gradwatch.checks.base import as_preview
from gradwatch.checks.batch_order_dependent import BatchOrderDependent
from gradwatch.checks.dependence_outside_receptive_field import DependenceOutsideReceptiveField
from gradwatch.checks.does_not_learn import DoesNotLearn
from gradwatch.checks.forward_not_reproducible import ForwardNotReproducible
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.registry import preview_ids
from gradwatch.checks.sample_dependence import SampleDependence
from gradwatch.checks.sample_weight_split import SampleWeightDependsOnSplit
from gradwatch.checks.update_ascends_loss import UpdateAscendsLoss
from gradwatch.config import GradWatchConfig
from gradwatch.model.engines import clean_name
from gradwatch.model.library import package_of
from gradwatch.probes._copies import Sharing
from gradwatch.probes._property_verdicts import (
    ascent_verdict,
    field_verdict,
    order_verdict,
    repro_verdict,
    split_verdict,
)
from gradwatch.probes._sandbox import Budget, CannotJudge, LossFn, rng_kept
from gradwatch.probes._verdicts import (
    gradient_verdict,
    not_judged,
    overfit_verdict,
    sample_verdict,
)
from gradwatch.probes.ascent import update_direction
from gradwatch.probes.gradient import gradient_agreement
from gradwatch.probes.order import order_dependence
from gradwatch.probes.overfit import overfit_one_batch
from gradwatch.probes.receptive import receptive_field
from gradwatch.probes.reproducible import reproducibility
from gradwatch.probes.samples import samples_reached
from gradwatch.probes.split import split_weights
from gradwatch.report import Finding, Report
from gradwatch.results import ProbeResult

__all__ = ["LOSS_FREE_PROBES", "PROBES", "RUNNERS", "probe", "run_probes"]

#: ``runner(model, batch, loss_fn, optimizer, cfg, budget, record)``: run one probe and
#: judge it into ``record``; its finding, if any. Adding a probe adds one entry here.
Runner = Callable[[nn.Module, Any, LossFn, Any, Any, Budget, ProbeResult], Optional[Finding]]


def _samples(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = samples_reached(m, b, fn, min_share=cfg.min_share, budget=budget, causal=cfg.causal)
    return sample_verdict(found, rec, cfg.severity, library=package_of(type(m)))


def _gradient(
    m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any
) -> Any:
    compared = gradient_agreement(
        m, b, fn, rtol=cfg.rtol, budget=budget, max_samples=cfg.max_samples
    )
    return gradient_verdict(compared, rec, cfg.severity)


def _overfit(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    trained = overfit_one_batch(
        m, b, fn, opt, steps=cfg.steps, ratio=cfg.ratio, max_samples=cfg.max_samples, budget=budget
    )
    return overfit_verdict(trained, rec, cfg.severity)


def _order(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = order_dependence(m, b, fn, rtol=cfg.rtol, budget=budget)
    if not cfg.compare_loss:
        found.loss = None
    return order_verdict(found, rec, cfg.severity)


def _repro(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = reproducibility(
        m, b, fn, rtol=cfg.rtol, budget=budget, stateful=cfg.stateful, allow=cfg.allow
    )
    return repro_verdict(found, rec, cfg.severity)


def _field(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = receptive_field(m, b, fn, min_share=cfg.min_share, budget=budget)
    return field_verdict(found, rec, cfg.severity)


def _ascent(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = update_direction(m, b, fn, opt, budget=budget)
    return ascent_verdict(found, rec, cfg.severity)


def _split(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = split_weights(m, b, fn, budget=budget)
    accumulates = (cfg.accumulation_steps or 1) > 1
    return split_verdict(found, rec, cfg.severity, tolerance=cfg.tolerance, accumulates=accumulates)


#: The checks that are probes and their runners, in the order they run.
RUNNERS: dict[str, Runner] = {
    SampleDependence.id: _samples,
    GradientMismatch.id: _gradient,
    DoesNotLearn.id: _overfit,
    ForwardNotReproducible.id: _repro,
    BatchOrderDependent.id: _order,
    DependenceOutsideReceptiveField.id: _field,
    UpdateAscendsLoss.id: _ascent,
    SampleWeightDependsOnSplit.id: _split,
}
PROBES = tuple(RUNNERS)
#: The probes that need no loss of the user's: they judge the model's outputs (or, for
#: ``gradient_mismatch``, any loss of them), so ``watch()`` runs them on the first batch it
#: sees with a fixed random projection of the model's outputs as the loss (:mod:`.auto`).
LOSS_FREE_PROBES = (
    SampleDependence.id,
    GradientMismatch.id,
    ForwardNotReproducible.id,
    BatchOrderDependent.id,
    DependenceOutsideReceptiveField.id,
)


def _guarded(
    check_id: str,
    cfg: Any,
    record: ProbeResult,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    opt: Any,
) -> Optional[Finding]:
    """Run one probe (its :data:`RUNNERS` entry) and judge it into ``record``; its finding,
    if any. The user's step may fail there, and warnings are the probe's own.

    A step the probe cannot run (the user's ``loss_fn`` frees a graph the probe backpropagates
    through, a model that refuses a copy) is :class:`CannotJudge`, never an exception out of
    ``gradwatch.probe``. Warnings raised on the copy (third-party noise such as opacus's) are
    recorded, not shown: under ``-W error`` they would fail the probe, and they are not the
    user's.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            runner = RUNNERS[check_id]
            return _attempt(
                lambda: runner(model, batch, loss_fn, opt, cfg, Budget(cfg.budget_s), record)
            )
        except CannotJudge:
            raise
        except Exception as exc:
            line = (str(exc).strip().splitlines() or [""])[0][:300]
            raise CannotJudge(
                "step_failed",
                f"the step failed on the probe's copy ({type(exc).__name__}: {line})",
            ) from exc
        finally:
            seen = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
            if seen:
                record.details["warnings"] = seen[:5]


#: The reasons a probe's step on a copy that shares the user's weights is tried again.
_RETRIED = frozenset({"step_failed", "loss_failed"})


def _attempt(run: Callable[[], Optional[Finding]]) -> Optional[Finding]:
    """``run()``, a probe on a copy that reads the user's weights
    (:func:`._copies.shared_copy`), and again on a copy of its own where its step failed
    there (an op that a shared weight cannot run, such as ``weight.tolist()``)."""
    failed: Optional[Exception] = None
    with Sharing() as share:
        try:
            return run()
        except Exception as exc:
            if getattr(exc, "reason", "step_failed") not in _RETRIED:
                raise
            failed = exc
    if not share.made:
        raise failed
    with Sharing(enabled=False):
        return run()


def _recorded(finding: Finding, model: nn.Module, config: GradWatchConfig) -> bool:
    """A probe's finding as the run's are recorded (``FindingLog.emit``): it names its
    parameters (the model's trainable ones when the probe judged the model as a whole:
    ``details.params_are``), is dropped when ``ignore`` matches every one, and a preview
    check's is ``info`` unless ``preview: true``. Whether it is kept."""
    if not finding.params and finding.check != NotObserved.id:
        named = model.named_parameters()
        finding.params = [clean_name(n) for n, p in named if p.requires_grad]
        finding.details["params_are"] = "the model's trainable parameters"
    patterns = config.ignore
    if patterns and finding.params:
        finding.params = [
            n for n in finding.params if not any(fnmatch.fnmatchcase(n, p) for p in patterns)
        ]
        if not finding.params:
            return False
    if finding.check in preview_ids():
        severity = as_preview(finding.severity, finding.details, preview=config.preview)
        finding.severity = severity  # type: ignore[assignment]
    return True


def run_probes(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Any = None,
    *,
    config: GradWatchConfig,
    only: Optional[Collection[str]] = None,
    time_limit: Optional[float] = None,
) -> tuple[list[ProbeResult], list[Finding]]:
    """Run every enabled probe on copies of ``model``: their records and their findings.

    Args:
        only: the probes to run (their order stays :data:`PROBES`'s); ``None``: all.
        time_limit: seconds for all of them together: each gets at most an even share of
            what is left (and never more than its own ``budget_s``).

    The global RNG state is restored on the way out, whatever happened.
    """
    records: list[ProbeResult] = []
    findings: list[Finding] = []
    chosen = [c for c in PROBES if (only is None or c in only) and config.check(c).enabled]
    start_all = time.perf_counter()
    with rng_kept(), torch.enable_grad():
        for k, check_id in enumerate(chosen):
            cfg = config.check(check_id)
            if time_limit is not None:
                share = (time_limit - (time.perf_counter() - start_all)) / (len(chosen) - k)
                own = float(getattr(cfg, "budget_s", share))
                cfg = cfg.model_copy(update={"budget_s": max(min(own, share), 1e-3)})
            record = ProbeResult(id=check_id, verdict=NotObserved.id)
            start = time.perf_counter()
            try:
                finding = _guarded(check_id, cfg, record, model, batch, loss_fn, optimizer)
            except CannotJudge as exc:
                if exc.partial is not None:
                    record.curve = list(getattr(exc.partial, "curve", []))
                    record.memory_bytes = int(getattr(exc.partial, "memory_bytes", 0))
                finding = not_judged(check_id, exc, record)
            record.seconds = time.perf_counter() - start
            if finding is not None and _recorded(finding, model, config):
                findings.append(finding)
            records.append(record)
    return records, findings


def probe(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    config: Union[GradWatchConfig, dict[str, Any], str, None] = None,
) -> Report:
    """Run the probes on copies of ``model`` and return a :class:`~gradwatch.Report`.

    Args:
        model: the module; never changed (each probe works on a deep copy).
        batch: one batch, passed to ``loss_fn`` as is (probes that take a few samples take
            them spread over the batch, first and last included).
        loss_fn: ``loss_fn(model, batch) -> Tensor``, a scalar loss, as for ``Probe``.
        optimizer: the user's optimizer: ``does_not_learn`` re-creates its class with its
            hyperparameters on the copy (never its state); ``None`` means Adam at 1e-3.
        config: a config, dict or path: each probe's ``enabled``, ``severity``, budget.

    Returns:
        A report with the probes' findings and its ``probes`` section.

    Example:
        >>> report = gradwatch.probe(model, (x, y), loss_fn, optimizer)  # doctest: +SKIP
        >>> report.raise_for_findings()  # doctest: +SKIP
    """
    cfg = GradWatchConfig.coerce(config)
    records, findings = run_probes(model, batch, loss_fn, optimizer, config=cfg)
    return Report(
        gradwatch_version=__version__,
        torch_version=torch.__version__,
        config=cfg,
        fail_on=cfg.fail_on,
        findings=findings,
        probes=records,
        failed=any(at_least(f.severity, cfg.fail_on) for f in findings),
    )
