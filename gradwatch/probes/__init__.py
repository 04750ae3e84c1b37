"""Probes: test the training step itself, on a copy of the model, before it costs a run.

Each probe is an experiment a careful practitioner runs by hand on a new setup (A. Karpathy,
"A Recipe for Training Neural Networks", 2019), here on a deep copy of the model inside
:func:`~gradwatch.probes._sandbox.rng_kept`: the user's weights, optimizer state, global RNG
state and data are never touched. ``gradient_mismatch`` checks the derivative numerically,
``sample_dependence`` charts which samples an output depends on, ``does_not_learn``
overfits one batch, ``update_ascends_loss`` checks that one step of the user's optimizer
descends; three properties of every correct model need no loss
(``forward_not_reproducible``, ``batch_order_dependent``,
``dependence_outside_receptive_field``: :data:`LOSS_FREE`). Each has a time budget (its
config's ``budget_s``); a probe that cannot
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
('dependence_outside_receptive_field', 'not_observed'), ('update_ascends_loss', 'not_observed')]
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from gradwatch._severity import at_least
from gradwatch._version import __version__
from gradwatch.checks.batch_order_dependent import BatchOrderDependent
from gradwatch.checks.dependence_outside_receptive_field import DependenceOutsideReceptiveField
from gradwatch.checks.does_not_learn import DoesNotLearn
from gradwatch.checks.forward_not_reproducible import ForwardNotReproducible
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.sample_dependence import SampleDependence
from gradwatch.checks.update_ascends_loss import UpdateAscendsLoss
from gradwatch.config import GradWatchConfig
from gradwatch.probes._property_verdicts import (
    ascent_verdict,
    field_verdict,
    order_verdict,
    repro_verdict,
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
from gradwatch.report import Finding, Report
from gradwatch.results import ProbeResult

__all__ = ["PROBES", "RUNNERS", "probe", "run_probes"]

#: ``runner(model, batch, loss_fn, optimizer, cfg, budget, record)``: run one probe and
#: judge it into ``record``; its finding, if any. Adding a probe adds one entry here.
Runner = Callable[[nn.Module, Any, LossFn, Any, Any, Budget, ProbeResult], Optional[Finding]]


def _samples(m: nn.Module, b: Any, fn: LossFn, opt: Any, cfg: Any, budget: Budget, rec: Any) -> Any:
    found = samples_reached(m, b, fn, min_share=cfg.min_share, budget=budget, causal=cfg.causal)
    return sample_verdict(found, rec, cfg.severity)


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


#: The checks that are probes and their runners, in the order they run.
RUNNERS: dict[str, Runner] = {
    SampleDependence.id: _samples,
    GradientMismatch.id: _gradient,
    DoesNotLearn.id: _overfit,
    ForwardNotReproducible.id: _repro,
    BatchOrderDependent.id: _order,
    DependenceOutsideReceptiveField.id: _field,
    UpdateAscendsLoss.id: _ascent,
}
PROBES = tuple(RUNNERS)
#: The probes that judge the model's outputs, not the loss: they run with any ``loss_fn``
#: that calls the model (``watch()`` can run them on the first batch it sees).
LOSS_FREE = (
    ForwardNotReproducible.id,
    BatchOrderDependent.id,
    SampleDependence.id,
    DependenceOutsideReceptiveField.id,
)


def _one(
    check_id: str,
    cfg: Any,
    record: ProbeResult,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    opt: Any,
) -> Optional[Finding]:
    """Run one probe and judge it into ``record``; its finding, if any."""
    return RUNNERS[check_id](model, batch, loss_fn, opt, cfg, Budget(cfg.budget_s), record)


def _guarded(
    check_id: str,
    cfg: Any,
    record: ProbeResult,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    opt: Any,
) -> Optional[Finding]:
    """:func:`_one`, where the user's step may fail and warnings are the probe's own.

    A step the probe cannot run (the user's ``loss_fn`` frees a graph the probe backpropagates
    through, a model that refuses a copy) is :class:`CannotJudge`, never an exception out of
    ``gradwatch.probe``. Warnings raised on the copy (third-party noise such as opacus's) are
    recorded, not shown: under ``-W error`` they would fail the probe, and they are not the
    user's.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _one(check_id, cfg, record, model, batch, loss_fn, opt)
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


def run_probes(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Any = None,
    *,
    config: GradWatchConfig,
) -> tuple[list[ProbeResult], list[Finding]]:
    """Run every enabled probe on copies of ``model``: their records and their findings.

    The global RNG state is restored on the way out, whatever happened.
    """
    records: list[ProbeResult] = []
    findings: list[Finding] = []
    with rng_kept(), torch.enable_grad():
        for check_id in PROBES:
            cfg = config.check(check_id)
            if not cfg.enabled:
                continue
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
            if finding is not None:
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
