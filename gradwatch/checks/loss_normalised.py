"""``loss_input_already_normalised``: a loss that normalises its input is given a normalised one.

Read from the loss's graph on scan steps (``loss_graph``): a ``LogSoftmax`` (what
``cross_entropy`` applies) whose input, through views and casts, is a ``Softmax`` or a
``Sigmoid``; an ``nll_loss`` whose input is a ``Softmax``/``Sigmoid`` (probabilities, not
log-probabilities); a ``binary_cross_entropy_with_logits`` whose input is a ``Sigmoid``.
``log_softmax`` + ``nll_loss``, ``log(softmax)`` + ``nll_loss``, label smoothing on logits,
``sigmoid`` + ``binary_cross_entropy`` are what the loss expects and never fire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.capture.loss.graph_walk import GraphDesc
from gradwatch.checks._loss_graph import ScanConfig, describe_producer, graph_record, named
from gradwatch.checks._params import upstream
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_SQUASH = {"SoftmaxBackward0": "softmax", "SigmoidBackward0": "sigmoid"}
# loss node -> (what the user called, what it expects, its own normalisation)
_LOSSES = {
    "LogSoftmaxBackward0": ("cross_entropy (or log_softmax)", "logits", "log_softmax"),
    "NllLossBackward0": ("nll_loss", "log-probabilities", "none: it takes logs as given"),
    "NllLoss2DBackward0": ("nll_loss", "log-probabilities", "none: it takes logs as given"),
    "BinaryCrossEntropyWithLogitsBackward0": (
        "binary_cross_entropy_with_logits (BCEWithLogitsLoss)",
        "logits",
        "sigmoid",
    ),
}
_FIX = {
    "LogSoftmaxBackward0": "Pass the logits (the layer before the {sq}) to cross_entropy, or "
    "apply log_softmax and use nll_loss; keep the {sq} for inference only.",
    "NllLossBackward0": "Use log_softmax instead of softmax before nll_loss (or cross_entropy "
    "on the logits).",
    "NllLoss2DBackward0": "Use log_softmax instead of softmax before nll_loss (or "
    "cross_entropy on the logits).",
    "BinaryCrossEntropyWithLogitsBackward0": "Pass the logits (before the sigmoid) to "
    "BCEWithLogitsLoss, or keep the sigmoid and use binary_cross_entropy (BCELoss).",
}


class LossInputNormalisedConfig(ScanConfig):
    """``loss_input_already_normalised``: scanned on the first ``scan_steps`` steps."""

    severity: Severity = severity_field("error")


class LossInputAlreadyNormalised(Check):
    """A loss that normalises its input got probabilities: softmax into cross-entropy,
    sigmoid into ``BCEWithLogits``, probabilities into NLL.

    The loss then computes ``log_softmax(softmax(z))`` (or ``sigmoid(sigmoid(z))``): its
    input lives in ``[0, 1]``, so the loss cannot go near zero and its gradients fade as the
    model grows confident; training runs, more slowly and to a worse model. Named by the loss
    and the module whose output was normalised.
    """

    id = "loss_input_already_normalised"
    maturity = "stable"
    Config = LossInputNormalisedConfig
    config: LossInputNormalisedConfig
    needs = frozenset({"loss_graph"})
    doc = CheckDoc(
        summary="A loss that normalises its input was given an already-normalised one: "
        "softmax probabilities into cross_entropy, sigmoid outputs into BCEWithLogits, "
        "probabilities (not log-probabilities) into nll_loss.",
        why="The loss normalises a second time: its input is squeezed into [0, 1], the loss "
        "has a floor far above zero and its gradients shrink as predictions sharpen, so the "
        "model trains slowly and ends worse, with nothing failing.",
        causes=(
            "A classifier whose forward ends in `nn.Softmax` / `F.softmax`, trained with "
            "`nn.CrossEntropyLoss` (a segmentation head's `Softmax2d` too).",
            "A binary/multi-label head ending in `torch.sigmoid`, trained with "
            "`BCEWithLogitsLoss`.",
            "`nll_loss(softmax(z))` where `nll_loss(log_softmax(z))` was meant (a policy "
            "gradient's `-log pi(a)` computed from probabilities).",
        ),
        fix="Give the loss the logits (move the softmax/sigmoid into inference code), or keep "
        "the normalisation and use the loss that expects it (log_softmax + nll_loss, sigmoid "
        "+ binary_cross_entropy).",
        detail="a loss that normalises its input was given an already-normalised one: softmax "
        "probabilities into `cross_entropy` (a `LogSoftmax` whose input, through views and casts, "
        "is a `Softmax` or `Sigmoid`), probabilities into `nll_loss`, sigmoid outputs into "
        "`BCEWithLogitsLoss`. Read from the loss's autograd graph on the first `scan_steps` (8) "
        "steps (node kinds, no values); named by the loss and the module whose output was "
        "normalised (`module: softmax`), `details.loss`, `details.input`, `details.backward_at`. "
        "`log_softmax` + `nll_loss`, `log(softmax)` + `nll_loss`, label smoothing and soft "
        "targets on logits, `sigmoid` + `binary_cross_entropy`, a distillation target's softmax "
        "are fine. Under `torch.compile` a softmax inside the compiled model is not seen (an "
        "`info` `not_observed`, `details.part: loss_graph`)",
    )

    def evidence(self) -> dict[str, int]:
        return {"loss_graph": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = graph_record(view)
        if rec is None:
            return
        for g in rec.graphs:
            for i, node in enumerate(g.nodes):
                if node.kind in _LOSSES and node.inputs:
                    self._judge(view, log, g, i)

    def _judge(self, view: StepView, log: FindingLog, g: GraphDesc, i: int) -> None:
        kind = g.nodes[i].kind
        j = g.through(g.nodes[i].inputs[0])
        squash = _SQUASH.get(g.nodes[j].kind)
        if squash is None or (kind.startswith("BinaryCross") and squash != "sigmoid"):
            return
        loss, expects, own = _LOSSES[kind]
        mark = g.producer(j)
        source = g.producer(g.nodes[j].inputs[0]) if mark is None and g.nodes[j].inputs else None
        if mark is not None:
            where = describe_producer(g, j)
        elif source is not None:
            where = f"{describe_producer(g, g.nodes[j].inputs[0])}, normalised in the loss code"
        else:
            where = "a value normalised in the loss code"
        producer = mark or source
        module = named(producer)
        shape = g.nodes[j].shape
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{loss} expects {expects} but is given {squash} outputs ({where}): "
            f"the loss normalises again ({own}), so it cannot reach zero and its gradients "
            "fade as predictions sharpen.",
            hint=_FIX[kind].format(sq=squash),
            params=upstream(view.index, g, j, producer.module if producer else None),
            module=module,
            details={
                "loss": loss,
                "input": squash,
                "module": module,
                "backward_at": g.backward_at,
                "shape": list(shape) if shape is not None else None,
            },
            key=f"{kind}:{squash}:{module}",
        )
