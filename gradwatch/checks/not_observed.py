"""``not_observed``: gradwatch could not see what it promises, so the report must not pass.

A report that says "no ghost" because no step was ever judged is a false green: the model ran
but no backward pass or optimizer step reached gradwatch (an optimizer it does not hold, hooks
that failed on every step, a parameter layout it cannot read). Other parts report reasons of
their own with :func:`emit_not_observed`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gradwatch._severity import Severity
from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.checks.base import Check, CheckConfig, WatchSettings, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import RunView, StructureView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

__all__ = ["NotObserved", "NotObservedConfig", "emit_not_observed"]

ID = "not_observed"

# Reasons that leave only some checks blind (they say which): ``info``, not a failure.
COMPILED = "compiled_forward"  # the reason of every part torch.compile hides (one finding)
PARTIAL_REASONS = frozenset({COMPILED, "fsdp1_replicas", "resume_resharded"})
#: ``details.reason`` when ``ignore`` matches every trainable parameter: nothing was judged.
ALL_IGNORED = "all_ignored"


def emit_not_observed(
    log: FindingLog,
    *,
    severity: str,
    step: int,
    reason: str,
    message: str,
    hint: str,
    params: Optional[list[str]] = None,
    details: Optional[dict[str, object]] = None,
) -> None:
    """Record that gradwatch could not observe something (one finding per ``reason``)."""
    log.emit(
        ID,
        severity=severity,
        step=step,
        message=message,
        hint=hint,
        params=params,
        key=reason,
        details={"reason": reason, **(details or {})},
    )


class NotObservedConfig(CheckConfig):
    """``not_observed``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class NotObserved(Check):
    """The run gave gradwatch nothing to judge, or its own hooks failed on every step."""

    id = ID
    maturity = "stable"
    Config = NotObservedConfig
    doc = CheckDoc(
        summary="The watcher could not see what it promises, so the report cannot be a pass.",
        why="A silent report would read as clean: no step observed, an unreadable parameter "
        "layout or failing hooks mean nothing was checked.",
        causes=(
            "The model ran but no optimizer step or backward pass happened while watching "
            "(the `with` block ended early, a different optimizer object stepped).",
            "Backward passes ran but the watched optimizer never stepped: a forgotten "
            "`optimizer.step()`, or a step that raised before reaching it (`no_step`).",
            "The watched model never ran at all: the loop trained a copy of it, or ran "
            "outside the `with` block (`details.reason: never_ran`).",
            "A parameter layout gradwatch cannot read (flattened FSDP1 parameters without "
            "`use_orig_params=True`).",
            "gradwatch's own hooks failed on every step (see `internal_error`).",
            "A GradScaler skipped every step: the gradients were non-finite on every batch "
            "(`all_steps_skipped`).",
            "The watcher was never entered (`w = watch(...)` without `with`: "
            "`never_entered`), or the model's parameters were replaced by new tensors during "
            "the run (`params_replaced`).",
        ),
        fix="Watch the optimizer that really steps and train inside the `with` block; use "
        "`use_orig_params=True` with FSDP1. `details.reason` says which case it was.",
        detail="gradwatch could not see what it promises, so the report never passes: the model "
        "ran but no backward pass or step was observed, or backward passes ran and the watched "
        "optimizer never stepped (a forgotten `optimizer.step()`, a step that raised first) "
        "(`details.reason: no_step`), the watched model never ran at all (`never_ran`: a copy "
        "trained, or the loop ran outside the block), its own hooks failed on every step "
        "(`hooks_failed`), the watched optimizer stopped stepping while its parameters kept "
        "changing (`optimizer_K_not_stepping`: an optimizer re-created mid-run), the model's "
        "parameters were replaced by tensors it never watched (`params_replaced`: "
        "`model.apply(reinit)` assigning new `nn.Parameter`s, with a new optimizer not given to "
        "`add_optimizer`), a GradScaler skipped every step (`all_steps_skipped`: non-finite "
        "gradients on every batch), the watcher was never entered (`never_entered`: `w = "
        "watch(...)` without `with`), a sharded layout it cannot read (`fsdp1_flat_params`, "
        "`sharded_after_watch`; `fsdp1_replicas` is `info`, see Sharded training)",
    )
    facts = frozenset({UNOBSERVABLE})
    #: Every parameter of the watched optimizers is outside the watched model (the optimizer
    #: of a copy was watched with the original).
    _trains_other = False

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._compiled_parts: dict[str, list[str]] = {}  # part hidden by compile -> its checks

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        """Something the run could not see, said as it was seen (one finding per reason)."""
        if fact.details.get("reason") == COMPILED:
            self._compiled(fact, log)
            return
        # Blind to a few checks only (the scout under torch.compile): said, the run still passes.
        partial = fact.details.get("reason") in PARTIAL_REASONS
        emit_not_observed(
            log,
            severity="info" if partial else self.severity,
            step=fact.step,
            reason=fact.key,
            message=fact.message,
            hint=fact.hint,
            params=fact.params,
            details=fact.details,
        )

    def _compiled(self, fact: Fact, log: FindingLog) -> None:
        """torch.compile hides several parts of the forward (its hooks, the loss's graph, the
        eval forwards), each seen by its own source: one ``info`` finding lists them all."""
        parts = self._compiled_parts
        checks_of_part = fact.details.get("checks")
        parts.setdefault(
            str(fact.details.get("part", "forward_hooks")),
            list(checks_of_part) if isinstance(checks_of_part, (list, tuple)) else [],
        )
        checks = sorted({c for named in parts.values() for c in named})
        emit_not_observed(
            log,
            severity="info",
            step=fact.step,
            reason=COMPILED,
            message="The model runs under torch.compile, where gradwatch adds no forward hooks "
            f"of its own (each would be a recompile) and the compiled region is one opaque "
            f"node of the loss's graph: {', '.join(parts)} not observed, so "
            f"{', '.join(checks)} cannot be checked. Ghost parameters, gradient statistics "
            "and the other checks run as usual.",
            hint=fact.hint,
            details={"parts": list(parts), "checks": checks, "by_part": dict(parts)},
        )

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        """``ignore`` that matches every trainable parameter: say that nothing is judged."""
        params = view.index.params
        held = view.in_optimizer
        self._trains_other = bool(held) and all(params[i].outside_model for i in held)
        ignored = getattr(log, "ignored", None)
        names = [n for i in view.trainable for n in view.index.params[i].names]
        if ignored is None or not names or not all(ignored(n) for n in names):
            return
        emit_not_observed(
            log,
            severity="info",
            step=0,
            reason=ALL_IGNORED,
            message=f"`ignore` matches every trainable parameter ({len(names)} ignored): "
            "nothing was judged, so this report is no pass.",
            hint="Narrow the `ignore` patterns to the parameters you mean to allowlist.",
            details={"ignored": len(names)},
        )

    def on_run(self, view: RunView, log: FindingLog) -> None:
        if view.steps > 0:
            # Steps whose gradients were all written by hand (DP-SGD with torch.func) were
            # judged on those gradients (core/steps.py): observed, not a blind spot.
            if not view.forward_ran and (
                self._trains_other or not (view.backward_passes or view.hand_written_steps)
            ):
                _another_instance(view, log, self.severity)
            return
        if view.faults:
            emit_not_observed(
                log,
                severity=self.severity,
                step=0,
                reason="hooks_failed",
                message="gradwatch's own hooks failed on every step "
                f"({', '.join(sorted(view.faults))}): no step was judged.",
                hint="Nothing was checked, so this run cannot pass: the traceback is in the "
                "finding of the failing place; please report it.",
                details={"faults": sorted(view.faults), "step_calls": view.step_calls},
            )
        elif view.backward_passes and not view.step_calls and view.skipped_steps:
            _all_skipped(view, log, self.severity)
        elif view.backward_passes and not view.step_calls and view.has_optimizer:
            # not_stepping said it better; a partial blind spot (info) says something else
            if not any(f.check == ID and f.severity != "info" for f in log.findings()):
                _never_stepped(view, log, self.severity)
        elif view.backward_passes == 0 and view.step_calls == 0 and not view.forward_ran:
            emit_not_observed(
                log,
                severity=self.severity,
                step=0,
                reason="never_ran",
                message="The watched model never ran: no forward pass, no backward pass and no "
                "optimizer step reached gradwatch, so nothing was checked.",
                hint="Run the training loop inside the watch() block (or between attach() and "
                "close()), on the model object passed to watch(): a copy or a model wrapped "
                "after watch() is not the one being watched.",
            )
        elif view.backward_passes == 0 and view.step_calls == 0:
            grad = "with gradients enabled" if view.forward_ran_with_grad else "only under no_grad"
            what = "optimizer step" if view.has_optimizer else "backward pass"
            emit_not_observed(
                log,
                severity=self.severity,
                step=0,
                reason="no_step",
                message=f"The model ran ({grad}) but no backward pass and no {what} was "
                "observed: nothing was checked.",
                hint="Call loss.backward() and optimizer.step() inside the watch() block, on "
                "the model and the optimizer object passed to watch() (an optimizer "
                "re-created later is not watched).",
            )
        elif not any(f.check == ID and f.severity != "info" for f in log.findings()):
            _interrupted(view, log, self.severity)


def _interrupted(view: RunView, log: FindingLog, severity: str) -> None:
    """No step was judged, and no case above says why: the run stopped inside its first step
    (a Ctrl-C between ``optimizer.step()``'s call and its end). Never a report that reads as
    clean."""
    emit_not_observed(
        log,
        severity=severity,
        step=0,
        reason="no_step",
        message="No step was judged: the run ended, or was interrupted, before its first step "
        f"completed ({view.backward_passes} backward pass(es), {view.step_calls} optimizer "
        "step call(s) begun).",
        hint="Nothing was checked, so this report is no pass: let the loop run at least one "
        "whole step inside the watch() block.",
        details={"backward_passes": view.backward_passes, "step_calls": view.step_calls},
    )


def _never_stepped(view: RunView, log: FindingLog, severity: str) -> None:
    """Backward passes ran, the watched optimizer never stepped: a forgotten
    ``optimizer.step()``, or a step that raised before reaching it (Opacus, DDP)."""
    unreached = ""
    if view.unreached:
        shown = ", ".join(view.unreached[:5]) + (", ..." if len(view.unreached) > 5 else "")
        unreached = f" No gradient reached {len(view.unreached)} parameter(s) ({shown})."
    emit_not_observed(
        log,
        severity=severity,
        step=0,
        reason="no_step",
        message=f"{view.backward_passes} backward pass(es) ran but the watched optimizer never "
        f"stepped: the model did not train, and no step was checked.{unreached}",
        hint="Call optimizer.step() after loss.backward(), on the optimizer object passed to "
        "watch(). If the loop stopped with an error before the first step, that error is the "
        "cause (a wrapper's step that raised before reaching the optimizer, e.g. Opacus on a "
        "parameter that got no gradient). To check backward passes alone (a gradient-flow "
        "test), watch without an optimizer: each backward pass is then judged as a step.",
        params=view.unreached or None,
        details={"backward_passes": view.backward_passes, "unreached": len(view.unreached)},
    )


def _all_skipped(view: RunView, log: FindingLog, severity: str) -> None:
    """A GradScaler skipped every optimizer step (inf/NaN gradients each time): the model
    never changed, and no step was judged."""
    emit_not_observed(
        log,
        severity=severity,
        step=0,
        reason="all_steps_skipped",
        message=f"The GradScaler skipped every optimizer step ({view.skipped_steps} of "
        f"{view.skipped_steps}) for inf/NaN gradients: the model never changed, and no step "
        "was checked.",
        hint="The loss or its gradients are non-finite on every batch (see nonfinite_grad): "
        "a scaler that skips now and then is expected, one that skips every step means "
        "nothing trained.",
        details={"skipped_steps": view.skipped_steps, "backward_passes": view.backward_passes},
    )


def _another_instance(view: RunView, log: FindingLog, severity: str) -> None:
    """The watched optimizer stepped, yet the watched model never ran and no backward pass
    reached it: the loop trained another instance (a ``deepcopy``, a model the loss built)."""
    emit_not_observed(
        log,
        severity=severity,
        step=0,
        reason="never_ran",
        message=f"The watched optimizer stepped {view.steps} time(s), but the watched model "
        "never ran and no backward pass reached it: another instance was trained (a copy, "
        "or a model that the loss function uses instead), so nothing was checked.",
        hint="Train the model object passed to watch() (and, for `gradwatch check`, use "
        "the Probe's model in its loss_fn): a copy of it is not the one being watched.",
        details={"steps": view.steps},
    )
