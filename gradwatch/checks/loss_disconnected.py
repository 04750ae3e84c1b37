"""``loss_disconnected``: the model ran and the optimizer stepped, but no gradient arrived."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

HINTS = {
    "disconnected": "The loss does not depend on the model's output: look for a loss rebuilt "
    "from a number (torch.tensor(loss.item(), requires_grad=True), .numpy(), .tolist()), a "
    ".detach() or .data on the output, or backward() called on another tensor.",
    "no_grad": "The model ran only with gradients disabled: the loss comes from a forward under "
    "torch.no_grad() / torch.inference_mode() (an evaluation or metric helper reused for "
    "training). Run the training forward with grad enabled.",
}


class LossDisconnectedConfig(CheckConfig):
    """``loss_disconnected``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class LossDisconnected(Check):
    """The loss was cut off from the model: a training step that cannot train anything.

    Meaning: in the window that ends at an optimizer step, the watched model's forward ran,
    yet no parameter (of any watched optimizer) received a gradient, so ``step()`` updated
    nothing (or only moved weights by momentum and weight decay).

    Causes: ``cause='disconnected'``: the forward ran in grad mode but the loss was rebuilt
    from ``.item()``/``.numpy()``/``.detach()``; ``cause='no_grad'``: the only forward ran
    under ``torch.no_grad``/``inference_mode`` (an evaluation helper reused for training).

    Fix: compute the loss from the model's output tensor, in grad mode.

    Not this bug: an optimizer left idle while another one trains (phases, GANs), gradients
    assigned by hand (``p.grad = torch.autograd.grad(...)``), a Lightning ``training_step``
    that returns ``None`` to skip a batch, a window in which the model did not run at all.
    Needs an optimizer: with ``watch(model)`` alone a backward that
    reaches no parameter is invisible (no hook fires), so there is no step at which "nothing
    arrived" could be judged; such a run ends with ``not_observed`` (``reason: no_step``)
    instead, which fails the report too.
    """

    id = "loss_disconnected"
    maturity = "stable"
    Config = LossDisconnectedConfig
    needs = frozenset({"forward_runs"})
    doc = CheckDoc(
        summary="An optimizer step ran after the model's forward, yet none of its parameters "
        "received a gradient: the loss does not depend on the model.",
        why="Every step is a no-op while the loss may still go down (it is computed from "
        "something else): the run looks alive and learns nothing.",
        causes=(
            "The loss was rebuilt from numbers: `torch.tensor(out.item())`, `.numpy()`, "
            "`.tolist()`.",
            "The output was detached: `out.detach()`, `out.data`.",
            "The forward ran under `torch.no_grad()` / `torch.inference_mode()` (an "
            "evaluation helper reused for training).",
        ),
        fix="Compute the loss from the model's output tensor directly and call `backward()` on "
        "it; keep `no_grad` for evaluation only. `details.cause` says which case it was.",
        detail="the model's forward ran and an optimizer stepped, yet no watched parameter "
        "received a gradient: a loss rebuilt from `.item()`/`.numpy()`/`.detach()` "
        "(`details.cause: disconnected`) or computed under `torch.no_grad` (`no_grad`). Judged "
        "per optimizer: with several models in one container, an optimizer whose layers ran with "
        "grad while a backward reached only the others' parameters (a GAN's generator step "
        "through `D(G(z).detach())`) fires too. An optimizer idle while another trains, a model "
        "run under `no_grad` in the other's phase, and a Lightning `training_step` returning "
        "`None`, are fine. Needs an optimizer (without one such a run fails as `not_observed`, "
        "`no_step`)",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._calls: dict[int, int] = {}  # per optimizer: backward() calls that reached nothing

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None or not view.ids or view.window.model_ran is None:
            return
        # Nothing may have arrived anywhere (another optimizer training in this window is a
        # phase switch, not a cut-off loss), and an integration that saw no backward() requested
        # (Lightning skipping a batch) rules it out.
        if any(view.arrived) or view.window.backward_called is False:
            return
        if view.backward_in_window:
            _cut_off_part(self, view, log)  # another model's parameters trained: this one?
            return
        if view.window.grads_assigned:
            return  # gradients set by hand (torch.autograd.grad, gradient surgery): not cut off
        cause = "disconnected" if view.window.model_ran == "grad" else "no_grad"
        names = view.index.names(view.ids)
        details: dict[str, object] = {"cause": cause, "optimizer": view.optimizer}
        said = ""
        calls = (view.window.records.get("loss") or {}).get("backward_calls")
        if calls:  # backward() ran, on a loss that reached none of the model's parameters
            total = self._calls[view.optimizer] = self._calls.get(view.optimizer, 0) + calls
            details["backward_calls"] = total
            said = f"; backward() ran {_times(total)} and reached none of them"
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"the model ran but {view.optimizer_name}.step() found no gradient on "
            f"any of its {len(names)} parameter(s): the loss is not connected to the model "
            f"(cause: {cause}){said}.",
            hint=HINTS[cause],
            params=names,
            key=f"optimizer[{view.optimizer}]",
            details=details,
        )


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _cut_off_part(check: LossDisconnected, view: StepView, log: FindingLog) -> None:
    """Several models in one container: a backward reached another optimizer's parameters,
    none of this one's, although its layers ran with grad in the window (a GAN's generator
    step through ``D(G(z).detach())``). Layers that did not run, or ran under ``no_grad``,
    are a phase switch (the other model trains now): fine. A layer whose forward hook was
    trimmed reads ``unknown`` and gets its hook back: judged at the next step."""
    trainable = [i for i in view.ids if view.index.params[i].ref() is not None]
    causes = {view.cause(i) for i in trainable}
    if not trainable or causes != {"disconnected"}:
        return
    names = view.index.names(trainable)
    log.emit(
        check.id,
        severity=check.severity,
        step=view.step,
        message=f"{view.optimizer_name}.step() found no gradient on any of its "
        f"{len(names)} parameter(s) although its layers ran with grad and a backward reached "
        "other parameters: its loss does not reach them (cause: disconnected; a detached "
        "output such as D(G(z).detach()) in the generator's loss?).",
        hint=HINTS["disconnected"],
        params=names,
        key=f"optimizer[{view.optimizer}]",
        details={"cause": "disconnected", "optimizer": view.optimizer},
    )
