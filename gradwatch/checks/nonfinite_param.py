"""``nonfinite_param``: NaN/Inf weights, also behind finite gradients.

A Linear whose weights hold NaN can still get finite gradients (its NaN rows are masked out,
an embedding row the batch never looks up, a head whose invalid classes are
``masked_fill``-ed): the gradients look healthy while the model holds garbage. The evidence is
the per-parameter norm every observed step already computes after the update (float32, on
device, read with the step's one transfer, ``gradwatch/measure/fingerprint.py``): a NaN/Inf
norm is a NaN/Inf weight. The first steps of a run are all observed
(``core/steps.py``), so weights broken by the first updates are seen at once.

The loss (``loss_value``, ``gradwatch/capture/loss/loose.py``): a device flag per
``loss.backward()`` root, and per loss a framework callback reports (Lightning's
``on_before_backward``, the HF Trainer's logged loss, ``Watcher.note_loss``), read with the
step's transfer. A NaN/Inf loss whose gradients are all finite (a non-finite term added
through ``.detach()`` or a constant) is this check's; with non-finite gradients it is
``nonfinite_grad``'s. A loss gradwatch never sees (``torch.autograd.backward(...)`` called
directly, a custom loop that gives no loss to ``note_loss``) is not judged: NaN weights are.

Weights made non-finite by a non-finite gradient (in this step, or applied by an earlier
one) are ``nonfinite_grad``'s (one root cause, one finding): this check speaks for weights
whose gradients were finite.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import LayerTable, StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog
    from gradwatch.model.index import ParamIndex


class NonfiniteParamConfig(CheckConfig):
    """``nonfinite_param``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


def _really_nonfinite(index: ParamIndex, ids: list[int]) -> bool:
    """An Inf float32 norm of finite values (elements past 1e19) is an overflow: recheck.

    Runs only on an Inf norm, so its host read never touches a healthy step.
    """
    for i in ids:
        p = index.params[i].ref()
        if p is None or not p.is_floating_point():
            continue
        values = p.coalesce()._values() if p.is_sparse else p
        if not bool(torch.isfinite(values).all()):
            return True
    return False


class NonfiniteParam(Check):
    """Per layer, on observed steps: a parameter norm that is NaN/Inf after the update."""

    id = "nonfinite_param"
    maturity = "stable"
    Config = NonfiniteParamConfig
    needs = frozenset({"loss_value"})
    doc = CheckDoc(
        summary="A parameter holds NaN/Inf after an optimizer step, or the loss is NaN/Inf, even "
        "though the gradients were finite.",
        why="NaN weights poison every output that reads them; while they sit in rows the "
        "batch does not use (embeddings, masked classes), the gradients stay finite and the "
        "loss may look normal, until the first batch that reads them.",
        causes=(
            "A loss term that is NaN/Inf but carries no gradient (`loss = ce + aux.detach()`, "
            "a logged statistic or a constant added to the loss): the weights train on, the "
            "loss curve and every metric computed from it are garbage.",
            "Adam/AdamW with `eps=0` (or fp16 weights, where `eps=1e-8` rounds to 0): a "
            "parameter whose gradient is exactly 0 (an embedding row not in the batch) gets "
            "0/0 = NaN.",
            "A checkpoint or an initialisation that left NaN/Inf values "
            "(`torch.empty` never filled, new token rows added by `resize_token_embeddings` "
            "from uninitialised memory).",
            "Code that edits the weights in place between steps (a division by a zero norm "
            "in a weight normalisation or an EMA update).",
        ),
        fix="Find the first step it fires at: check the optimizer's `eps` (keep weights in "
        "float32 under mixed precision), the checkpoint's values "
        "(`torch.isfinite(t).all()` per tensor after loading), and any code that writes "
        "`.data` or `param.copy_`.",
        detail="a parameter holds NaN/Inf after an optimizer step although its gradients are "
        "finite (embedding rows the batch never reads, updated by Adam with `eps=0` or fp16 "
        "weights: 0/0; rows loaded or grown from uninitialised memory). Read from the parameter "
        "norms every observed step computes; the first steps are observed, so it fires at the "
        "step that made them. Where the gradients are non-finite too, `nonfinite_grad` reports it "
        "(one finding). `details.value`: `nan`/`inf`. Also a NaN/Inf loss whose gradients are all "
        "finite (a term added through `.detach()`, a constant, a logged statistic): "
        "`details.cause: loss`; the loss is read as a device flag per `loss.backward()` (and per "
        "loss the Lightning/HF callbacks or `Watcher.note_loss` hand over), with the step's one "
        "transfer",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._grad_spread: set[object] = set()  # optimizers that applied a non-finite gradient

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if any(view.nonfinite) and not view.scaler:  # a GradScaler skips such steps
            self._grad_spread.add(view.optimizer)
        if view.window.loss_finite is False and not any(view.nonfinite):
            self._loss(view, log)
        # A non-finite gradient (now, or applied by an earlier step) is nonfinite_grad's
        # finding: the weights it spread into are the same root cause.
        if not view.layers or any(view.nonfinite) or view.optimizer in self._grad_spread:
            return
        isfinite = math.isfinite
        pn = LayerTable.of(view.layers).param_norm
        if None not in pn and all(map(isfinite, pn)):  # type: ignore[arg-type]
            return  # every layer's weights finite: the usual step, no call per layer
        judged = set(view.ids)
        for layer, s in view.layers.items():
            if s.param_norm is None or isfinite(s.param_norm):
                continue
            ids = [i for i in view.index.layers.get(layer, []) if i in judged]
            ids = ids or [view.ids[k] for k in s.positions]
            if math.isinf(s.param_norm) and not _really_nonfinite(view.index, ids):
                continue
            where = f" after {view.optimizer_name}.step()" if view.optimizer is not None else ""
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': its weights hold NaN/Inf{where} although its "
                "gradients were finite (NaN weights behind a finite gradient).",
                hint="Look at what wrote these values: an optimizer step with eps=0 (Adam) or "
                "fp16 weights, a checkpoint holding NaN, or code that edits the weights in "
                "place. Check with torch.isfinite(p).all() after loading and after the first "
                "step.",
                params=view.index.names(ids),
                module=layer,
                details={
                    "optimizer": view.optimizer,
                    "value": "nan" if math.isnan(s.param_norm) else "inf",
                },
            )

    def _loss(self, view: StepView, log: FindingLog) -> None:
        where = f" at {view.optimizer_name}'s step" if view.optimizer is not None else ""
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"the loss was NaN/Inf{where} while every gradient was finite: a term of "
            "the loss that carries no gradient (added through .detach(), a constant or a "
            "logged statistic) is non-finite.",
            hint="Check each term of the loss with torch.isfinite(term) before summing; a term "
            "added as .detach() or .item() contributes no gradient but poisons the loss value "
            "(and the metrics, schedulers and early stopping that read it).",
            params=view.index.names(view.ids),  # the parameters this loss trains
            key="loss",
            details={"cause": "loss", "optimizer": view.optimizer},
        )
