"""``loss_input_out_of_domain``: a torch loss was given values outside its documented domain.

A property of every correct program: each loss gets what its documentation says it takes.
The evidence (``loss_inputs``, :mod:`gradwatch.capture.loss.loss_domain`) is every
``torch.nn.functional`` loss call of the scan steps, however it was imported or wrapped
(``nn`` loss modules call these), with cheap reductions of its constrained arguments:
BCE-family targets (and BCE's input) in [0, 1]; ``nll_loss``/``kl_div``/``ctc_loss`` inputs
as log-probabilities (<= 0); ``kl_div`` targets as probabilities (or log-probabilities with
``log_target=True``); cross-entropy probability targets that sum to one per sample (a
masked, all-zero row aside); ±1 labels for the margin losses; non-negative Poisson counts
(and rates with ``log_input=False``); class indices in [0, C) (``ignore_index`` aside).

Correct and silent: label smoothing and soft targets in [0, 1], mixup's mixed one-hot rows,
``kl_div`` with ``log_target=True``, distillation with a temperature, masked rows of zeros.
Probabilities from a softmax or sigmoid handed to ``nll_loss`` are
``loss_input_already_normalised``'s (one cause, one finding); computed any other way, they
are this check's.

Not judged: a loss written by hand (``-(y * p.log()).sum()``), a library's own loss that
calls no torch loss, a loss under torch.compile, a ``kl_div`` whose distributions do not
sum to one (partial distributions are a design), whether a distribution lies along the
right axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gradwatch._severity import Severity
from gradwatch.capture.loss.loss_domain import LossCall
from gradwatch.checks._loss_graph import ScanConfig
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.capture.loss.domains import Demand
    from gradwatch.checks.base import FindingLog

_TOL = 1e-4  # float rounding of targets built by arithmetic (1 - 0.9 + 0.9)
_DIST_TOL = 1e-3  # a float32 row sum of probabilities
_EXPECT = {
    "unit": "values in [0, 1]",
    "logprob": "log-probabilities (values <= 0)",
    "nonneg": "non-negative values",
    "pm1": "labels of -1 and +1 only",
    "dist": "rows that sum to one along the class dim",
    "index": "class indices in [0, C)",
}
_FIX = {
    "unit": "Scale the target into [0, 1] (a {0, 255} mask: `mask / 255` or `mask > 0`), "
    "or use the loss that matches the labels.",
    "logprob": "Give the loss log-probabilities: `log_softmax(logits, dim)` (or use "
    "`cross_entropy` on the logits).",
    "nonneg": "Poisson targets are counts or rates (>= 0), with `log_input=False` the input "
    "is a rate (>= 0, use `log_input=True` for a log-rate); class and positive weights are "
    ">= 0 (a weight from `1 - frequency` or a log-ratio can turn negative).",
    "pm1": "Map {0, 1} labels to {-1, +1} (`2 * y - 1`).",
    "dist": "Normalise the soft targets per sample (`t / t.sum(dim, keepdim=True)`), or pass "
    "class indices.",
    "index": "Targets are class indices in [0, C); mark positions to skip with ignore_index.",
}


class LossInputOutOfDomainConfig(ScanConfig):
    """``loss_input_out_of_domain``: read on the first ``scan_steps`` steps."""

    severity: Severity = severity_field("error")


def _violation(d: Demand, v: list[float], call: LossCall) -> Optional[str]:
    """What lies outside the domain, in words, or ``None``."""
    if d.domain == "unit" and (v[0] < -_TOL or v[1] > 1 + _TOL):
        return f"values in [{v[0]:.4g}, {v[1]:.4g}]"
    if d.domain == "logprob" and v[0] > _TOL:
        if call.loss == "nll_loss" and call.normalised is not None:
            return None  # probabilities from a softmax/sigmoid: loss_input_already_normalised
        return f"a largest value of {v[0]:.4g} (a log-probability is <= 0)"
    if d.domain == "nonneg" and v[0] < 0:
        return f"a smallest value of {v[0]:.4g}"
    if d.domain == "pm1" and v[0] > _TOL:
        return f"a label {v[0]:.4g} away from ±1 (labels other than -1 and +1, such as 0)"
    if d.domain == "dist" and v[0] > max(_DIST_TOL, d.tol):
        return f"a row whose sum is {v[0]:.4g} away from 1"
    if d.domain == "index" and d.extra is not None and (v[0] < 0 or v[1] >= d.extra):
        return f"indices in [{v[0]:.0f}, {v[1]:.0f}] for C = {d.extra}"
    return None


class LossInputOutOfDomain(Check):
    """Per scan step: each loss call whose input or target lies outside the loss's domain,
    named by the loss, the argument and the user's line."""

    id = "loss_input_out_of_domain"
    maturity = "stable"
    Config = LossInputOutOfDomainConfig
    config: LossInputOutOfDomainConfig
    needs = frozenset({"loss_inputs"})
    doc = CheckDoc(
        summary="A torch loss was given inputs or targets outside its documented domain: "
        "BCE targets outside [0, 1], probabilities where log-probabilities are expected, "
        "{0, 1} labels to a ±1 margin loss, negative Poisson counts, soft targets that do "
        "not sum to one.",
        why="Torch computes the formula anyway: the loss is finite, its gradients flow, and "
        "it optimises something other than the objective (a BCE target of 255 rewards "
        "pushing the probability past 1; a {0, 1} hinge label ignores every negative pair). "
        "No correct program gives a loss values outside its domain.",
        causes=(
            "A segmentation mask loaded as {0, 255} uint8 and fed to `BCELoss` / "
            "`BCEWithLogitsLoss`.",
            "`KLDivLoss` given probabilities (`softmax`) as its input, or a "
            "log-probability target without `log_target=True`.",
            "`HingeEmbeddingLoss`, `CosineEmbeddingLoss`, `MarginRankingLoss` or "
            "`SoftMarginLoss` given {0, 1} labels.",
            "`NLLLoss` / `CTCLoss` given raw logits instead of `log_softmax`.",
            "`cross_entropy` with multi-hot or unnormalised soft targets.",
        ),
        fix="Transform the values into the loss's domain (scale the mask, `log_softmax`, "
        "`2 * y - 1`), or use the loss whose domain the values are in.",
        detail="a torch loss was given inputs or targets outside its documented domain: "
        "BCE-family targets (and BCE inputs) outside [0, 1] (a {0, 255} mask), a "
        "non-log-probability input to `nll_loss`, `kl_div` or `ctc_loss` (raw logits, `softmax` "
        "probabilities), a `kl_div` target outside [0, 1] (or above 0 with `log_target=True`), "
        "`cross_entropy` soft targets whose rows do not sum to one (multi-hot), {0, 1} labels to "
        "a ±1 margin loss (`HingeEmbedding`, `SoftMargin`, `MarginRanking`, `CosineEmbedding`), "
        "negative Poisson counts (or rates with `log_input=False`), negative class or positive "
        "weights, class indices outside [0, C) (`ignore_index` aside). Read on the first "
        "`scan_steps` (8) steps by a `TorchFunctionMode` pushed from the model's forward to "
        "`backward()` (any import form, `nn` loss modules, a loss computed in `forward`), as "
        "device-side reductions read with the step's one transfer; named by the loss and the "
        "user's line and the parameters upstream of its prediction (`params`, `module`: the "
        "nearest) (`details.loss`, `details.loss_module`, `details.argument`, `details.domain`, "
        "`details.observed`, `details.called_at`). Label smoothing, soft targets in [0, 1], mixup "
        "rows, masked all-zero rows, `log_target=True`, distillation with a temperature are fine; "
        "`nll_loss` on a softmax's output is `loss_input_already_normalised`'s. Hand-written "
        "losses and `kl_div` distributions that do not sum to one are not judged; under "
        "`torch.compile` an `info` `not_observed`",
    )

    def evidence(self) -> dict[str, int]:
        return {"loss_inputs": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = view.window.records.get("loss_domain")
        if rec is None:
            return
        for call in rec.calls:
            for d, v in zip(call.demands, call.values):
                what = _violation(d, v, call) if v else None
                if what is not None:
                    self._emit(view, log, call, d, v, what)

    def _emit(
        self, view: StepView, log: FindingLog, call: LossCall, d: Demand, v: list[float], what: str
    ) -> None:
        name = f"{call.module} ({call.loss})" if call.module else call.loss
        at = f" at {call.site}" if call.site else ""
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{name}{at} expects its {d.role} to hold {_EXPECT[d.domain]}, and was "
            f"given {what}: the loss is computed anyway and optimises something else.",
            hint=_FIX[d.domain],
            params=call.params or None,
            module=call.producer,
            details={
                "loss": call.loss,
                "loss_module": call.module,
                "argument": d.role,
                "domain": d.domain,
                "observed": [round(x, 6) for x in v],
                "called_at": call.site,
                "settings": call.settings,
            },
            key=f"{call.loss}:{d.role}:{d.domain}:{call.site}",
        )
