"""Probes: test the training step itself, on a copy of the model, before it costs a run.

Each probe is an experiment a careful practitioner runs by hand on a new setup (A. Karpathy,
"A Recipe for Training Neural Networks", 2019), here on a deep copy of the model inside
:func:`~gradwatch.probes._sandbox.rng_kept`: the user's weights, optimizer state, global RNG
state and data are never touched. ``gradient_mismatch`` checks the derivative numerically,
``sample_dependence`` charts which samples an output depends on, ``does_not_learn``
overfits one batch. Each has a time budget (its config's ``budget_s``); a probe that cannot
judge says so as an ``info`` ``not_observed`` finding and ``verdict: not_observed`` in the
report's ``probes`` section, never as a pass.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> batch = (torch.randn(8, 4), torch.randn(8, 1))
    >>> report = probe(model, batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    >>> [(p.id, p.verdict) for p in report.probes]
    [('sample_dependence', 'passed'), ('gradient_mismatch', 'passed'), ('does_not_learn', 'passed')]
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, Optional, Union

import torch
from torch import nn

from gradwatch._severity import at_least
from gradwatch._version import __version__
from gradwatch.checks.does_not_learn import DoesNotLearn, DoesNotLearnConfig
from gradwatch.checks.gradient_mismatch import GradientMismatch, GradientMismatchConfig
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.sample_dependence import SampleDependence, SampleDependenceConfig
from gradwatch.config import GradWatchConfig
from gradwatch.probes._sandbox import Budget, CannotJudge, LossFn, rng_kept
from gradwatch.probes._verdicts import (
    gradient_verdict,
    not_judged,
    overfit_verdict,
    sample_verdict,
)
from gradwatch.probes.gradient import gradient_agreement
from gradwatch.probes.overfit import overfit_one_batch
from gradwatch.probes.samples import samples_reached
from gradwatch.report import Finding, Report
from gradwatch.results import ProbeResult

__all__ = ["LOSS_FREE_PROBES", "PROBES", "probe", "run_probes"]

#: The checks that are probes, in the order they run (the cheapest first).
PROBES = (SampleDependence.id, GradientMismatch.id, DoesNotLearn.id)

#: The probes that need no loss of the user's: ``watch()`` runs them on the first batch with
#: a fixed random projection of the model's outputs as the loss (:mod:`.auto`).
LOSS_FREE_PROBES = (SampleDependence.id, GradientMismatch.id)


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
    budget = Budget(cfg.budget_s)
    if isinstance(cfg, SampleDependenceConfig):
        found = samples_reached(
            model, batch, loss_fn, min_share=cfg.min_share, budget=budget, causal=cfg.causal
        )
        return sample_verdict(found, record, cfg.severity)
    if isinstance(cfg, GradientMismatchConfig):
        compared = gradient_agreement(
            model, batch, loss_fn, rtol=cfg.rtol, budget=budget, max_samples=cfg.max_samples
        )
        return gradient_verdict(compared, record, cfg.severity)
    assert isinstance(cfg, DoesNotLearnConfig), check_id
    trained = overfit_one_batch(
        model,
        batch,
        loss_fn,
        opt,
        steps=cfg.steps,
        ratio=cfg.ratio,
        max_samples=cfg.max_samples,
        budget=budget,
    )
    return overfit_verdict(trained, record, cfg.severity)


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
                finding = _one(check_id, cfg, record, model, batch, loss_fn, optimizer)
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
        batch: one batch, passed to ``loss_fn`` as is (probes use its first samples).
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
