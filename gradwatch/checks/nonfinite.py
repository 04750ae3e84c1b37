"""``nonfinite_grad``: NaN/Inf in a gradient, with the place where it was born."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.capture.facts import SKIPPED_STEPS, Fact
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog
    from gradwatch.model.index import ParamIndex

HINT_BY_HAND = (
    "The loop wrote this gradient into .grad itself (torch.autograd.grad, torch.func, a merge "
    "of task gradients): check that computation (a division by a zero norm, log(0))."
)
HINT_BACKWARD = (
    "Look at the operation that consumes this parameter: sqrt/log/div at 0 (also inside "
    "torch.where, whose untaken branch still back-propagates), overflow in fp16 (use a "
    "GradScaler or bf16), or a too-high learning rate."
)
HINT_FORWARD = (
    "The forward pass of '{module}' turned finite inputs into NaN/Inf: a division by a zero "
    "norm (add an eps), log/sqrt of 0 or of a negative value, or fp16 logits overflowing "
    "(compute them in float32, or scale before the softmax)."
)
HINT_LOSS = (
    "Every module output was finite but the gradient reaching the model's output was not: "
    "the loss computation made it (log(0), division by a zero count, a NaN target). Clamp "
    "its inputs (e.g. log(p.clamp_min(1e-12))) or use the library loss (cross_entropy)."
)
HINT_INPUT = (
    "The NaN/Inf is in the data, not the model: check the dataset and its preprocessing "
    "(missing values read as NaN, a normalisation by a zero standard deviation, log of 0 in "
    "a feature transform). Drop or impute those samples, or assert torch.isfinite(batch) "
    "in the data pipeline."
)
HINT_WEIGHTS = (
    " The weights were already non-finite at the next step (the optimizer applied the NaN, or "
    "its update overflowed: fp16 weights with Adam), so the forward origin cannot be traced: "
    "run with a GradScaler (it skips such steps) or stop at the first NaN to trace it."
)

HINT_UPDATE = (
    "The optimizer's update turned finite gradients into NaN/Inf weights. With fp16 "
    "parameters, Adam's eps=1e-8 rounds to 0 and its step divides by zero: keep the weights "
    "in float32 (torch.autocast computes in fp16 without it), use bf16, or raise eps. "
    "Otherwise the learning rate is far too high, or code edits the weights between steps."
)


class NonfiniteGradConfig(CheckConfig):
    """``nonfinite_grad``: NaN/Inf in a gradient, traced to where it was born."""

    severity: Severity = severity_field("error")
    trace_steps: StrictInt = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="After the first non-finite gradient, per-module finiteness flags stay on "
        "for up to this many optimizer steps to find the module where the NaN/Inf is born "
        "(the next step where it recurs ends them). 0: never trace.",
    )


def _first_param(index: ParamIndex, module: str) -> Optional[str]:
    """The first parameter owned by ``module`` or by a module inside it."""
    for layer, ids in index.layers.items():
        if ids and (layer == module or module == "(root)" or layer.startswith(module + ".")):
            return index.params[ids[0]].name
    return None


class NonfiniteGrad(Check):
    """A gradient holds NaN/Inf; ``details.phase`` says where it was born.

    Meaning: some parameter's gradient is not finite; an optimizer step with it writes NaN
    into the weights.

    Causes and phases: ``forward`` (a module whose inputs were finite produced a non-finite
    output: a normaliser dividing by a zero norm, overflowing fp16 logits),
    ``loss`` (the model's output was finite, the loss made it: ``log(0)``),
    ``backward`` (everything finite in the forward: e.g. ``sqrt`` at 0, whose derivative is
    infinite). ``details.origin_module`` names the module, ``details.origin`` its first
    parameter. The phase is traced by per-module device-side flags armed after the first
    non-finite gradient, so it is known at the latest at the next step where it recurs
    (``phase: null`` until then, or when the weights were already corrupted).

    Fix: see the hint of the phase found. With a ``GradScaler``, a step it skips is ``info``.
    """

    id = "nonfinite_grad"
    maturity = "stable"
    Config = NonfiniteGradConfig
    config: NonfiniteGradConfig

    doc = CheckDoc(
        summary="A gradient holds NaN or Inf; details.phase says where it was born (forward: "
        "details.origin_module is the first module whose finite inputs gave a non-finite "
        "output; loss; backward: details.origin is the first parameter in backward order).",
        why="One NaN step poisons the weights (and Adam's state) for good: the loss turns NaN "
        "and the run is lost, often long after the cause.",
        causes=(
            "sqrt/log/division at 0, also inside torch.where, whose untaken branch still "
            "back-propagates.",
            "A normaliser dividing by a zero norm, log(0) in a hand-written loss.",
            "fp16 overflow (logits, attention scores), with or without a GradScaler.",
            "A learning rate so high that activations overflow.",
            "NaN/Inf in the input batch (details.phase: input, details.input names the "
            "argument): missing values, a normalisation by a zero standard deviation.",
            "An update that overflows the weights from finite gradients (fp16 weights with "
            "Adam, whose eps=1e-8 rounds to 0): details.update_step names that step.",
        ),
        fix="Look at the operation that consumes details.origin; guard the input (clamp, eps), "
        "use a GradScaler or bf16, or lower the learning rate. Steps a GradScaler skips are "
        "expected and reported as info.",
        detail="NaN/Inf in a gradient. `details.phase`: `forward` (`details.origin_module` is the "
        "first module whose inputs were finite and output was not: a zero-norm normaliser, "
        "overflowing logits), `loss` (the model's output was finite, the loss made it: `log(0)`), "
        "`backward` (finite forward: `sqrt` at 0); `details.origin` is that module's first "
        "parameter (for `backward`: the first parameter in backward order). Traced by device-side "
        "finiteness flags during the first steps and, after a NaN, for up to `trace_steps` (20) "
        "steps, so known at the latest at the next step where it recurs (`phase: null` until "
        "then, or when the update already made the weights NaN: `details.weights_nonfinite`, and "
        "`details.update_step` when that step's gradients were all finite, so its update itself "
        "overflowed, e.g. fp16 weights with Adam). Phase `input`: the batch already held it "
        "(`details.input` names the argument, `args[0]` or a keyword; `details.origin_module` is "
        "the first module that received it). Steps a `GradScaler` skips are `info`",
    )

    facts = frozenset({SKIPPED_STEPS})
    needs = frozenset({"nan_probe"})

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._trace: Optional[dict[str, Any]] = None
        self._episode: Optional[tuple[str, Any]] = None  # (finding key, origin) of this run
        self._clean: dict[Optional[int], int] = {}  # optimizer -> its last all-finite step
        self._after_clean: Optional[int] = None  # that step, when this run followed it

    def on_step(self, view: StepView, log: FindingLog) -> None:
        bad = [k for k, b in enumerate(view.nonfinite) if b]
        if not bad:
            self._episode = None  # a finite step ends the run of non-finite ones
            self._clean[view.optimizer] = view.step
            return
        # Backward visits parameters from the loss outwards; the earliest arrival is the origin,
        # the later ones inherited the NaN/Inf from it.
        arrived_bad = [k for k in bad if view.arrived[k]] or bad
        origin_k = min(arrived_bad, key=lambda k: view.order[k])
        origin = view.index.params[view.ids[origin_k]]
        names = view.index.names([view.ids[k] for k in bad])
        new = view.window.nan_trace
        if self._episode is None:
            # One finding per run of consecutive non-finite steps, keyed by where it started:
            # once an update spread the NaN into the weights, backward order starts elsewhere.
            self._episode = (origin.layer, origin)
            self._trace = new
            # The weights already non-finite in the forward of the first non-finite step,
            # right after a step whose gradients were all finite: that update made them.
            last = self._clean.get(view.optimizer)
            born = new is not None and new.get("weights_nonfinite") and last == view.step - 1
            self._after_clean = last if born else None
        elif new is not None and (new.get("phase") or self._trace is None):
            self._trace = new  # a conclusive trace replaces an inconclusive one
        key, origin = self._episode
        trace = self._trace or {}
        phase = trace.get("phase")
        module = origin.layer
        origin_name: Optional[str] = origin.name
        if phase == "input":
            module = trace.get("origin_module") or "(root)"
            origin_name = _first_param(view.index, module)
            where = (
                f"it arrives with the data: the model's input '{trace['input']}' already holds "
                f"NaN/Inf (first received by '{module}')"
            )
            hint = HINT_INPUT
        elif phase == "forward":
            module = trace["origin_module"]
            origin_name = _first_param(view.index, module)
            where = f"it is born in the forward pass of '{module}' (finite inputs, NaN/Inf output)"
            hint = HINT_FORWARD.format(module=module)
        elif phase == "loss":
            module = "(loss)"
            where = "it is born in the loss, after the model (the model's output was finite)"
            hint = HINT_LOSS
        elif phase == "backward":
            where = f"it is born in the backward pass at '{origin.name}' (the forward was finite)"
            hint = HINT_BACKWARD
        elif view.world_size == 1 and view.written and all(view.written[k] for k in bad):
            where = f"it is in '{origin.name}', whose gradient no backward pass made (set by hand)"
            hint = HINT_BY_HAND
        elif trace.get("weights_nonfinite") and self._after_clean is not None:
            where = (
                "the weights were already NaN/Inf in this step's forward, though every gradient "
                f"of step {self._after_clean} was finite: that step's update made them"
            )
            hint = HINT_UPDATE
        else:
            where = f"it starts at '{origin.name}' (first in backward order)"
            hint = HINT_BACKWARD + (HINT_WEIGHTS if trace.get("weights_nonfinite") else "")
            if not trace and self.config.trace_steps > 0:
                where += "; its forward origin is traced when it recurs"
        details: dict[str, Any] = {
            "origin": origin_name,
            "origin_layer": origin.layer,
            "origin_module": module,
            "phase": phase,
            "nonfinite_params": len(names),
        }
        if phase == "input":
            details["input"] = trace["input"]
        if trace.get("weights_nonfinite"):
            details["weights_nonfinite"] = True
            if self._after_clean is not None:
                details["update_step"] = self._after_clean
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"non-finite gradient (NaN/Inf) in {len(names)} parameter(s); {where}.",
            hint=hint,
            params=names,
            module=module,
            key=key,
            details=details,
        )

    def evidence(self) -> dict[str, Any]:
        """The NaN probe, armed for ``trace_steps`` steps after a non-finite gradient."""
        return {"nan_probe": self.config.trace_steps}

    @classmethod
    def call_site(cls, finding: Any) -> Optional[str]:
        """A NaN born in a module's forward: the line that called that module."""
        details = finding.details
        if details.get("phase") != "forward":
            return None
        origin = details.get("origin_module") or finding.module
        return origin if isinstance(origin, str) else None

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        """Steps the GradScaler skipped (:data:`~gradwatch.capture.facts.SKIPPED_STEPS`)."""
        d = fact.details
        self.on_skipped(d["skipped"], d["total"], fact.step, log, d.get("trace"))

    def on_skipped(
        self,
        skipped: int,
        total: int,
        step: int,
        log: FindingLog,
        trace: Optional[dict[str, Any]] = None,
    ) -> None:
        """A GradScaler skipped ``skipped`` steps for inf/NaN gradients: expected, ``info``.

        When the NaN probe saw a module turn finite inputs into inf/NaN in the forward (fp16
        logits overflowing), no loss scale can fix it: the finding says where.
        """
        details: dict[str, Any] = {"skipped_steps": total, "cause": "grad_scaler"}
        message = (
            f"GradScaler skipped {total} optimizer step(s) because gradients held inf/NaN "
            "(expected while the loss scale calibrates)."
        )
        hint = (
            "Nothing to do unless skips keep happening after the first steps; then look for "
            "a NaN source (run without autocast to find its origin)."
        )
        if trace is not None and trace.get("phase") == "forward":
            module = trace["origin_module"]
            details.update(phase="forward", origin_module=module)
            message = (
                f"GradScaler skipped {total} optimizer step(s); the inf/NaN is born in the "
                f"forward pass of '{module}' (finite inputs, non-finite output), which no loss "
                "scale fixes."
            )
            hint = HINT_FORWARD.format(module=module)
        log.emit(
            self.id,
            severity="info",
            step=step,
            message=message,
            hint=hint,
            key="grad_scaler",
            details=details,
        )
