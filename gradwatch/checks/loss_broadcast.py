"""``loss_broadcast``: a prediction compared with its target after broadcasting to a shape
that neither has, so every sample meets every target.

Read from the loss's graph on scan steps (``loss_graph``), in the loss's own ops (those
between the root and the model's outputs; the first few nodes when no module was observed):
an elementwise op against a value that needs no gradient (the target), or a loss kernel
whose input was expanded, where the prediction was stretched along a dimension it has size
1 in, to the size of one of its own other dimensions: ``(N,1)`` against ``(N,)`` gives
``(N,N)``. Broadcasting along a dimension the prediction really has (K ensemble heads
``(K,N)`` against one ``(N,)`` target) stretches only the target and is fine; pairwise
distances between two outputs of the model (both need gradients) are by design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gradwatch._severity import Severity
from gradwatch.capture.loss.graph_walk import GraphDesc
from gradwatch.checks._loss_graph import ScanConfig, describe_producer, graph_record, named
from gradwatch.checks._params import upstream
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_ELEMENTWISE = frozenset(
    {"SubBackward0", "AddBackward0", "MulBackward0", "DivBackward0", "RsubBackward0"}
)
_KERNELS = {
    "MseLossBackward0": "mse_loss",
    "L1LossBackward0": "l1_loss",
    "SmoothL1LossBackward0": "smooth_l1_loss",
    "HuberLossBackward0": "huber_loss",
    "BinaryCrossEntropyBackward0": "binary_cross_entropy",
    "BinaryCrossEntropyWithLogitsBackward0": "binary_cross_entropy_with_logits",
}
_NEAR_ROOT = 12  # nodes of the loss's own ops when no module output was observed


def stretched(a: tuple[int, ...], out: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """``(d, e)``: ``a`` broadcast to ``out`` was stretched along dim ``d`` (size 1 or absent
    there) to the size of dim ``e``, one it really has (the same samples, crossed)."""
    if len(out) < 2 or len(a) > len(out):
        return None
    al = (1,) * (len(out) - len(a)) + tuple(a)
    grown = [d for d in range(len(out)) if al[d] == 1 and out[d] > 1]
    kept = [e for e in range(len(out)) if al[e] == out[e] and out[e] > 1]
    for d in grown:
        for e in kept:
            if out[d] == out[e]:
                return d, e
    return None


class LossBroadcastConfig(ScanConfig):
    """``loss_broadcast``: scanned on the first ``scan_steps`` steps."""

    severity: Severity = severity_field("error")


class LossBroadcast(Check):
    """A loss's prediction and target were broadcast to a shape neither has.

    ``(N,1)`` predictions against ``(N,)`` targets become an ``(N,N)`` difference: each
    prediction is pulled towards the mean of all targets, the loss still goes down, and the
    model learns the batch mean. Named by the loss op and the module whose output it is.
    """

    id = "loss_broadcast"
    maturity = "stable"
    Config = LossBroadcastConfig
    config: LossBroadcastConfig
    needs = frozenset({"loss_graph"})
    doc = CheckDoc(
        summary="A loss compared its prediction with its target after broadcasting both to a "
        "shape neither has (`(N,1)` against `(N,)` gives `(N,N)`): every sample is compared "
        "with every target.",
        why="The loss averages over all prediction/target pairs, so each prediction is pulled "
        "towards the batch's mean target: the loss falls, the model regresses to the mean, "
        "and nothing fails (PyTorch's size warning is easy to miss in a log).",
        causes=(
            "A regression head `nn.Linear(d, 1)` (shape `(N,1)`) with `mse_loss` against a "
            "`(N,)` target.",
            "An actor-critic value loss `(values - returns).pow(2).mean()` with values "
            "`(N,1)` from the critic and returns `(N,)`.",
            "A DQN `q.gather(1, a)` (shape `(N,1)`) against a `(N,)` TD target in "
            "`smooth_l1_loss`.",
        ),
        fix="Make both shapes equal before the loss: `pred.squeeze(-1)` (or `target."
        "unsqueeze(-1)`), or `view_as`; assert the shapes once in the training step.",
        detail="a loss compared its prediction with its target after broadcasting both to a shape "
        "neither has: `(N,1)` against `(N,)` gives `(N,N)` (`mse_loss`/`smooth_l1_loss` on a "
        "regression head or a DQN's `q.gather(1, a)`, an actor-critic's `(values - "
        "returns).pow(2)`). Read from the loss's own ops in its graph (between the root and the "
        "model's outputs) on the first `scan_steps` (8) steps: the prediction was stretched along "
        "a dimension it has size 1 in to the size of one of its own. K ensemble heads `(K,N)` "
        "against one `(N,)` target, pairwise distances between two outputs of the model, "
        "per-sample weights are fine. `details.prediction_shape`, `details.broadcast_shape`, "
        "`details.op`",
    )

    def evidence(self) -> dict[str, int]:
        return {"loss_graph": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = graph_record(view)
        if rec is None:
            return
        for g in rec.graphs:
            region = g.loss_region() if g.marked else set(range(min(_NEAR_ROOT, len(g.nodes))))
            for i in sorted(region):
                hit = self._candidate(g, i)
                if hit is not None:
                    self._emit(view, log, g, i, *hit)

    def _candidate(self, g: GraphDesc, i: int) -> Optional[tuple[int, tuple[int, ...]]]:
        """``(prediction node, broadcast shape)`` when node ``i`` crossed samples."""
        node = g.nodes[i]
        if len(node.inputs) != 1 or node.consts < 1:
            return None  # two values that need gradients (pairwise distances), or neither
        pred = node.inputs[0]
        if node.kind in _KERNELS and g.nodes[pred].kind == "ExpandBackward0":
            out = g.nodes[pred].shape
            pred = g.nodes[pred].inputs[0] if g.nodes[pred].inputs else pred
        elif node.kind in _ELEMENTWISE:
            out = node.shape
        else:
            return None
        a = g.nodes[pred].shape
        if out is None or a is None or stretched(a, out) is None:
            return None
        return pred, out

    def _emit(
        self,
        view: StepView,
        log: FindingLog,
        g: GraphDesc,
        i: int,
        pred: int,
        out: tuple[int, ...],
    ) -> None:
        a = g.nodes[pred].shape or ()
        op = _KERNELS.get(g.nodes[i].kind) or g.nodes[i].kind.replace("Backward0", "").lower()
        mark = g.producer(pred)
        module = named(mark)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{op} compared a prediction of shape {tuple(a)} ({describe_producer(g, pred)}) "
            f"with its target after broadcasting to {tuple(out)}: every sample is compared with "
            "every target, so predictions are pulled towards the batch mean.",
            hint=f"Make the shapes equal before the loss (pred.squeeze(-1) or target.view_as("
            f"pred)); the broadcast went from {tuple(a)} to {tuple(out)}.",
            params=upstream(view.index, g, pred, mark.module if mark else None),
            module=module,
            details={
                "op": op,
                "prediction_shape": list(a),
                "broadcast_shape": list(out),
                "module": module,
                "backward_at": g.backward_at,
            },
            key=f"{module}:{tuple(a)}:{tuple(out)}",
        )
