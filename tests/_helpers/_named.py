"""SPEC 8.1's naming contract, run over every check's own tests: each finding names its
parameters (``params``) and, where it is about one module, that module (``module``).

:func:`named_findings` is an autouse fixture of ``tests/checks`` and ``tests/probes``: it
records every finding a test's watchers and probes produce (a spy on
``FindingLog.findings`` and ``gradwatch.probes.run_probes``, nothing else changed) and fails
the test when one breaks the contract. So every scenario a check's tests train (their
realistic violating forms) is a case of this contract, and a new check's tests are too.

The exceptions are listed here, each with its reason, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import pytest

from gradwatch.results import Finding

__all__ = ["MODULE_LESS", "NO_PARAMS", "broken", "named_findings"]

Case = Callable[[Finding], bool]

#: Findings that legitimately name no parameter: about the run or gradwatch itself.
NO_PARAMS: dict[str, tuple[Case, str]] = {
    "not_observed": (
        lambda f: True,
        "what gradwatch could not see (nothing ran, a compiled forward, a probe that could "
        "not judge, every parameter ignored): about the run, not a parameter",
    ),
    "internal_error": (lambda f: True, "a fault in gradwatch's own code: no parameter is at fault"),
    "resume_mismatch": (
        lambda f: f.details.get("aspect") != "params",
        "a resumed run's counters (an optimizer's step counts or learning rates, a "
        "scheduler, the loop's step) are compared with the saved state, which keeps them "
        "per optimizer index, not per parameter",
    ),
    "nonfinite_grad": (
        lambda f: f.details.get("cause") == "grad_scaler",
        "steps a GradScaler skipped are the scaler's count (info), told by the scaler, "
        "which names no parameter",
    ),
}

#: Checks whose findings are about an optimizer, a param group, a step or the run, not one
#: module: they name their parameters, and may name no module.
MODULE_LESS: dict[str, str] = {
    "missing_zero_grad": "an optimizer's step",
    "step_without_grad": "an optimizer's step",
    "double_update": "optimizers' steps",
    "double_backward": "an optimizer's step (a module when one layer is reached)",
    "loss_disconnected": "an optimizer's step",
    "clip_after_step": "an optimizer's step",
    "clipped_while_scaled": "an optimizer's step under a GradScaler",
    "clip_without_effect": "a clipping call, meant for an optimizer's parameters",
    "scheduler_misstepped": "an optimizer's scheduler",
    "stale_param": "a param group (a module when one layer is stale)",
    "optimizer_hparams_degenerate": "a param group's hyperparameters",
    "decay_on_excluded_params": "param groups' weight decay",
    "not_in_optimizer": "the optimizers' coverage (a module when one layer is left out)",
    "frozen_in_optimizer": "the optimizers' coverage",
    "resume_mismatch": "a resumed run's state",
    "tie_broken": "two parameter objects over one storage, in different modules",
    "unregistered_param": "tensors held outside any module (a module when one holds them)",
    "param_outside_model": "optimizer tensors outside the model",
    "graph_retained_across_steps": "the training loop keeps the loss's graph",
    "nonfinite_param": "a non-finite loss (a layer when a parameter is non-finite)",
    "nonfinite_grad": "a GradScaler's skipped steps (a module where the NaN is born)",
    "ghost_param": "a group of ghosts across layers, or the old parameters of a layer "
    "replaced after the optimizer was built (its layer when it is one)",
    "sample_dependence": "a probe of the model as a whole",
    "batch_order_dependent": "a probe of the model as a whole (the loss's value; a module "
    "when one moved first)",
    "forward_not_reproducible": "a probe of the model as a whole (a module when its state "
    "is named)",
    "dependence_outside_receptive_field": "a probe of the model as a whole (the op that "
    "regrouped the axes)",
    "does_not_learn": "a probe of the model as a whole",
    "gradient_mismatch": "a direction over every layer (a module when one layer disagrees)",
    "loss_broadcast": "a prediction computed in the loss code, outside the model's modules",
    "loss_term_dominates": "a loss term whose input no module produced",
    "update_ascends_loss": "a param group's update (the optimizer's step, on a copy)",
    "sample_weight_depends_on_split": "an optimizer step's micro-batches",
    "call_without_effect": "an optimizer's hyperparameter write (a module when its mode, "
    "freeze or load did not take effect)",
    "not_observed": "the run",
    "internal_error": "gradwatch itself",
}


def broken(f: Finding) -> list[str]:
    """How ``f`` breaks the contract (empty: it keeps it)."""
    out = []
    excused = NO_PARAMS.get(f.check)
    if not f.params and not (excused and excused[0](f)):
        out.append("names no parameter")
    if not f.module and f.check not in MODULE_LESS:
        out.append("names no module")
    return [f"{f.check} {what}: {f.line()[:160]}" for what in out]


@pytest.fixture(autouse=True)
def named_findings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Finding]]:
    """Every finding the test produced, checked against the contract at its end."""
    import gradwatch.probes as probes
    from gradwatch.core.findings import FindingLog

    seen: list[Finding] = []
    findings, run_probes = FindingLog.findings, probes.run_probes

    def all_findings(self: FindingLog) -> list[Finding]:
        out = findings(self)
        seen.extend(out)
        return out

    def probed(*args: Any, **kwargs: Any) -> Any:
        records, found = run_probes(*args, **kwargs)
        seen.extend(found)
        return records, found

    monkeypatch.setattr(FindingLog, "findings", all_findings)
    monkeypatch.setattr(probes, "run_probes", probed)
    yield seen
    problems = sorted({p for f in seen for p in broken(f)})
    if problems:
        pytest.fail("SPEC 8.1, every finding names its parameters:\n" + "\n".join(problems))
