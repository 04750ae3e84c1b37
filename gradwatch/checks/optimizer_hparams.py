"""``optimizer_hparams_degenerate``: hyperparameters that make an optimizer another one.

Adam-family ``betas`` written as ``1 - beta`` (``(0.1, 0.001)``) average the squared
gradient over a step or two, so Adam divides by the current gradient (sign descent);
``beta2 < beta1`` forgets the second moment faster than the first. Both are read from the
param groups once per layout (``model_as_built``). An ``eps`` larger than ``sqrt(v_hat)``
for most elements makes the step ``lr * m / eps``: momentum SGD at ``lr / eps``; that is
measured once from ``exp_avg_sq`` after a few steps (``adam_moments``), never from a fixed
number.

Correct and silent: GPT's betas (0.9, 0.95), GANs' beta1 = 0 or 0.5, the default eps, and
optimizers gradwatch does not know (Adafactor, Lion, 8-bit states): what they do not expose
is not judged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.checks._as_built import AsBuiltCheck
from gradwatch.checks._params import group_params
from gradwatch.checks.base import CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class OptimizerHparamsConfig(CheckConfig):
    """``optimizer_hparams_degenerate``: when eps is said to dominate."""

    severity: Severity = severity_field("warning")
    eps_share: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Share of a group's elements (those that "
        "have seen a gradient) where eps >= sqrt(v_hat) that makes Adam act as SGD.",
    )
    at_step: int = Field(
        default=4, ge=0, strict=True, description="Step after which the second moments are read."
    )


class OptimizerHparamsDegenerate(AsBuiltCheck):
    """Betas once per layout read; eps against the measured second moments once."""

    id = "optimizer_hparams_degenerate"
    maturity = "stable"
    Config = OptimizerHparamsConfig
    needs = frozenset({"model_as_built", "adam_moments"})
    doc = CheckDoc(
        summary="An optimizer's hyperparameters make it another optimizer: Adam-family betas "
        "in the 1 - beta convention, beta2 < beta1, or an eps that dominates the measured "
        "sqrt(v_hat) for most elements (Adam acting as SGD).",
        why="The run trains with an optimizer nobody chose: sign descent, an unstable second "
        "moment, or SGD at an lr of lr/eps. It still moves, so nothing looks wrong.",
        causes=(
            "`betas=(0.1, 0.001)` copied from a paper that writes 1 - beta.",
            "`betas=(0.999, 0.9)`: the two swapped.",
            "`eps=1e-3` (or 1.0) from a TensorFlow recipe on gradients of 1e-5.",
        ),
        fix="Use decay rates close to 1 with beta1 < beta2 (0.9, 0.999; 0.9, 0.95 for large "
        "models) and a small eps (1e-8; 1e-6 under fp16).",
        detail="an Adam-family param group's hyperparameters make it another optimizer: `betas` "
        "in the 1 - beta convention (`(0.1, 0.001)`), `beta2 < beta1`, or an `eps` at least "
        "`sqrt(v_hat)` for more than `eps_share` (half) of the group's elements that have seen a "
        "gradient, measured once from `exp_avg_sq` after `at_step` (4) steps (Adam acting as SGD "
        "at lr/eps; judged from the moments, never a fixed eps). GPT's (0.9, 0.95), GANs' beta1 = "
        "0 or 0.5, the default eps and optimizers whose state it does not know (Adafactor, Lion, "
        "8-bit states) are fine. `details.optimizer`, `details.group`, `details.hparam`, "
        "`details.value`",
    )

    def evidence(self) -> dict[str, Any]:
        return {"model_as_built": True, "adam_moments": self.config.at_step}  # type: ignore[attr-defined]

    def on_step(self, view: StepView, log: FindingLog) -> None:
        records = view.window.records
        built = self.fresh(view)
        if built is not None:
            for d in built.degenerate:
                self._emit(
                    view,
                    log,
                    d.group.optimizer,
                    d.group.group,
                    d.hparam,
                    d.message,
                    d.hint,
                    {"value": d.group.hparams.get(d.hparam)},
                )
        for share in records.get("adam_moments") or []:
            frac = share.dominated / share.measured if share.measured else 0.0
            if frac < self.config.eps_share:  # type: ignore[attr-defined]
                continue
            self._emit(
                view,
                log,
                share.optimizer,
                share.group,
                "eps",
                f"eps={share.eps:g} is at least sqrt(v_hat) for {frac:.0%} of the group's "
                f"elements after {share.step + 1} steps: there the step is lr * m / eps, "
                "momentum SGD at lr/eps.",
                "Lower eps to the gradients' scale (1e-8 is Adam's default; 1e-6 under fp16), "
                "or use SGD with momentum if that is what is meant.",
                {"value": share.eps, "share": round(frac, 4), "measured": share.measured},
            )

    def _emit(
        self,
        view: StepView,
        log: FindingLog,
        k: int,
        g: int,
        hparam: str,
        message: str,
        hint: str,
        extra: dict[str, Any],
    ) -> None:
        label = view.index.optimizer_label(k)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{label} param group {g}: {message}",
            hint=hint,
            params=group_params(view, k, g),
            key=f"{k}:{g}:{hparam}",
            details={"optimizer": label, "group": g, "hparam": hparam, **extra},
        )
