"""``normalised_over_batch``: a softmax in the model's forward runs across the batch dimension.

Read from the loss's graph on scan steps (``loss_graph``): a ``Softmax``/``LogSoftmax`` node
computed inside a watched module's forward (a module's output, or below one) whose dim is 0
on a tensor whose first dim is the model's batch (the first dim of its input), so each
sample's output depends on the others. ``Softmax(dim=1)`` over actions or classes, attention
over keys, a samples x samples logits matrix (InfoNCE, CLIP: both dims are the batch, by
design), a loss's own softmax outside the model, and batch norm in train mode (the known
exception, not a softmax) never fire. A model holding a module with ``batch_first=False``
(an ``nn.LSTM``/``nn.MultiheadAttention`` default) may be time-major, where dim 0 is time and
a softmax over it is attention over time: it is not judged, and an ``info``
``not_observed`` (``time_major``) says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.capture.loss.graph_walk import GraphDesc
from gradwatch.checks._loss_graph import ScanConfig, graph_record
from gradwatch.checks._params import upstream
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.not_observed import emit_not_observed
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_SOFTMAX = {"SoftmaxBackward0": "softmax", "LogSoftmaxBackward0": "log_softmax"}


class NormalisedOverBatchConfig(ScanConfig):
    """``normalised_over_batch``: scanned on the first ``scan_steps`` steps."""

    severity: Severity = severity_field("error")


class NormalisedOverBatch(Check):
    """A softmax inside the model normalises over the batch: samples change each other's
    outputs, the probabilities of one sample do not sum to one, and the model's predictions
    at batch size 1 (inference) differ from training. Named by the module that ran it."""

    id = "normalised_over_batch"
    maturity = "stable"
    Config = NormalisedOverBatchConfig
    config: NormalisedOverBatchConfig
    needs = frozenset({"loss_graph"})
    doc = CheckDoc(
        summary="A softmax (or log_softmax) in the model's forward runs across the batch "
        "dimension (dim 0 of a batch-first tensor), so each sample's output depends on the "
        "other samples of its batch.",
        why="The outputs of one sample no longer sum to one over its classes or actions; the "
        "model learns a batch-level statistic, and at inference (another batch size, one "
        "sample) its predictions change.",
        causes=(
            "A policy network ending in `nn.Softmax(dim=0)` (written for one state, then "
            "trained on batches of states).",
            "Attention pooling `softmax(scores, dim=0)` over a `(B, T)` score, where `dim=1` "
            "(over time) was meant.",
            "`F.log_softmax(x)` without `dim` on a 3-D `(B, T, C)` output: PyTorch's implicit "
            "choice is dim 0 for 0-, 1- and 3-D inputs.",
        ),
        fix="Give the softmax the dimension of the classes/actions/positions (`dim=-1` for a "
        "batch-first tensor).",
        silence=(
            "A loss that normalises over the batch on purpose (InfoNCE, CLIP's samples x "
            "samples logits) is not judged: both of its dims are the batch.",
        ),
        detail="a softmax or log_softmax computed inside the model's forward (a module's output "
        "or below one) runs over dim 0 of a tensor whose first dim is the model's batch (its "
        "input's first dim), so samples change each other's outputs: a policy's "
        "`nn.Softmax(dim=0)` trained on batches of states, attention pooling `softmax(scores, "
        "dim=0)`, `F.log_softmax(x)` without `dim` on a 3-D output (PyTorch picks dim 0). Read "
        "from the loss's graph on the first `scan_steps` (8) steps; named by the module that ran "
        "it. `Softmax(dim=1)` over actions, attention over keys or time, a samples x samples "
        "logits matrix (InfoNCE, CLIP, in the loss or inside the model), a loss's softmax outside "
        "the model and train-mode batch norm (the known exception, not a softmax) are fine; a "
        "model holding a `batch_first=False` module (an `nn.LSTM`/`nn.MultiheadAttention` "
        "default: dim 0 may be time) and other normalisations (`x / x.sum(0)`) are not judged. "
        "`details.shape`, `details.batch`",
    )

    def evidence(self) -> dict[str, int]:
        return {"loss_graph": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = graph_record(view)
        if rec is None:
            return
        for g in rec.graphs:
            if not g.marked or not g.batch or g.batch < 2:
                continue
            inside = None
            for i, node in enumerate(g.nodes):
                if node.kind not in _SOFTMAX or not _over_batch(node.shape, node.settings, g):
                    continue
                inside = g.in_model() if inside is None else inside
                if i not in inside:
                    continue
                if g.time_major:
                    self._unjudged(view, log, g, i)
                else:
                    self._emit(view, log, g, i)

    def _unjudged(self, view: StepView, log: FindingLog, g: GraphDesc, i: int) -> None:
        """A softmax over dim 0 in a model that may be time-major: said, not judged."""
        module = g.enclosing(i) or g.model
        emit_not_observed(
            log,
            severity="info",
            step=view.step,
            reason="time_major",
            message=f"A {_SOFTMAX[g.nodes[i].kind]} over dim 0 runs in the forward of "
            f"'{module or 'the model'}', but the model holds a module with batch_first=False, "
            "so dim 0 may be time (attention over time) rather than the batch: "
            "normalised_over_batch does not judge it.",
            hint="If the model is batch-first throughout, set batch_first=True on its "
            "recurrent and attention modules; the sample_dependence probe (gradwatch check) "
            "judges the dependence itself either way.",
            details={"check": self.id, "module": module},
        )

    def _emit(self, view: StepView, log: FindingLog, g: GraphDesc, i: int) -> None:
        node = g.nodes[i]
        inside = g.enclosing(i)
        module = inside or g.model  # the model itself: named by its class
        op = _SOFTMAX[node.kind]
        shape = tuple(node.shape or ())
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"A {op} in the forward of '{module or 'the model'}' normalises over dim 0 of a {shape} tensor, the batch (size "
            f"{g.batch}): each sample's output depends on the other samples of its batch.",
            hint=f"Give the {op} the dimension of the classes/actions (dim=-1 for a "
            "batch-first tensor); an implicit dim (F.softmax(x) on a 3-D input) picks dim 0.",
            params=upstream(view.index, g, i, inside),  # the module's and those upstream
            module=module,
            details={"op": op, "dim": 0, "shape": list(shape), "batch": g.batch},
            key=f"{module}:{op}:{shape}",
        )


def _over_batch(shape: object, settings: dict[str, object], g: GraphDesc) -> bool:
    if not isinstance(shape, tuple) or len(shape) < 2:
        return False
    dim = settings.get("dim")
    if not isinstance(dim, int):
        return False
    dim = dim + len(shape) if dim < 0 else dim
    if dim != 0 or shape[0] != g.batch:
        return False
    # samples x samples (InfoNCE, CLIP): the batch twice, by design
    return sum(1 for s in shape if s == g.batch) < 2
