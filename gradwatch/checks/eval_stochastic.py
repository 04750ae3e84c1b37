"""``eval_forward_stochastic``: a forward in eval mode ran dropout as in training.

From the ``eval_forward`` source (``gradwatch/capture/forward/eval_dropout.py``): during the watched
model's first ``scan_forwards`` eval-mode forwards, a functional dropout called with
``training=True`` (its default) and ``p > 0`` from the forward of a module in eval mode.
``F.dropout(x, p, training=self.training)``, ``nn.Dropout`` modules and dropout modules put
back in train mode on purpose (Monte-Carlo dropout) are fine; dropout kept on by design
(Tacotron 2's prenet) is silenced with ``ignore`` on the module's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.capture.facts import EVAL_STOCHASTIC, Fact
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class EvalForwardStochasticConfig(CheckConfig):
    """``eval_forward_stochastic``: how many eval-mode forwards are watched."""

    severity: Severity = severity_field("warning")
    scan_forwards: StrictInt = Field(
        default=4,
        ge=0,
        le=1_000_000,
        description="Eval-mode forwards of the watched model (whenever they run) during which "
        "the functional dropouts are watched. 0: never.",
    )


class EvalForwardStochastic(Check):
    """An eval-mode forward executed dropout as in training: validation metrics are noisy
    and pessimistic, predictions differ from call to call, and early stopping or checkpoint
    selection follow the noise. Named by the module whose forward called it."""

    id = "eval_forward_stochastic"
    maturity = "stable"
    Config = EvalForwardStochasticConfig
    config: EvalForwardStochasticConfig
    needs = frozenset({"eval_forward"})
    facts = frozenset({EVAL_STOCHASTIC})
    doc = CheckDoc(
        summary="A forward run with the model in eval mode executed dropout as in training "
        "(`F.dropout(x, p)` without `training=self.training`).",
        why="`model.eval()` does not reach a functional dropout: its `training` argument "
        "defaults to True. Validation scores are noisy and too low, inference is not "
        "deterministic, and model selection follows the noise.",
        causes=(
            "`F.dropout(x, 0.1)` in a custom attention or MLP block's forward.",
            "`nn.functional.dropout2d(feat, p)` in a segmentation decoder.",
            "Dropout on embeddings or hidden states written functionally in an RNN language "
            "model (`F.dropout(emb, self.p)`).",
        ),
        fix="Pass the module's mode: `F.dropout(x, p, training=self.training)`, or use an "
        "`nn.Dropout` submodule.",
        silence=(
            "Dropout kept on at inference by design (Tacotron 2's prenet, Monte-Carlo "
            'dropout written functionally): `ignore: ["decoder.prenet.*"]` on that '
            "module's parameters.",
        ),
        detail="a forward run with the model in eval mode executed dropout as in training: "
        "`F.dropout(x, p)` (whose `training` defaults to True), `F.dropout2d`, ... called with "
        "`training=True` and `p > 0` from the forward of a module in eval mode, during the "
        "model's first `scan_forwards` (4) eval-mode forwards, whenever they run (a validation "
        "after the last step too; the functional dropouts are wrapped only for the length of "
        "those forwards). Named by the module whose forward called it, with `details.called_at`. "
        "`training=self.training`, `nn.Dropout` modules and Monte-Carlo dropout through "
        "`nn.Dropout` modules put back in train mode are fine; dropout on by design (Tacotron 2's "
        "prenet) is silenced by `ignore` on that module's parameters (`ignore: "
        '["decoder.prenet.*"]`). A function imported by name before watching (`from '
        "torch.nn.functional import dropout`) is not seen; under `torch.compile` nothing is (an "
        "`info` `not_observed`, `details.part: eval_forward`). `details.function`, `details.p`",
    )

    def evidence(self) -> dict[str, int]:
        return {"eval_forward": self.config.scan_forwards}

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        d = fact.details
        log.emit(
            self.id,
            severity=self.severity,
            step=fact.step,
            message=f"{d['module_class']} '{d['module']}' called F.{d['function']}(p={d['p']:g}) "
            "with training=True while the model was in eval mode: its eval forward is "
            "stochastic (validation and inference see dropout).",
            hint=f"Pass training=self.training to F.{d['function']}"
            + (f" at {d['called_at']}" if d.get("called_at") else "")
            + ", or use an nn.Dropout submodule; if it is on by design, add its parameters "
            "to `ignore`.",
            params=fact.params,
            module=d["module"],
            details=d,
            key=fact.key,
        )
