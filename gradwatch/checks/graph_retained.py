"""``graph_retained_across_steps``: earlier steps' autograd graphs stay alive, more each step.

Read from the ``loss_graph`` source: the root node of each backward described on a scan
step carries a token that lives exactly as long as that node; a token of an earlier step
still alive after later optimizer steps means something holds that step's loss with its
graph (``running_loss += loss``, ``losses.append(loss)``). One step kept for a comparison
(``prev_loss = loss``) does not grow and is fine; ``loss.item()`` / ``loss.detach()`` keep
no graph at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._loss_graph import ScanConfig, graph_record
from gradwatch.checks._params import upstream
from gradwatch.checks.base import Check, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class GraphRetainedConfig(ScanConfig):
    """``graph_retained_across_steps``: how many earlier graphs alive, and growing, fire."""

    severity: Severity = severity_field("warning")
    min_retained: StrictInt = Field(
        default=3,
        ge=2,
        le=1000,
        description="Earlier steps' graphs alive at once (and more than at the step before) "
        "that fire it.",
    )


class GraphRetainedAcrossSteps(Check):
    """A previous step's autograd graph is still alive after its optimizer step, and the
    number of retained graphs grows.

    Every step's graph (its nodes, and until backward its saved activations) is kept: host
    and device memory grow through the epoch until the run slows down or runs out of
    memory, and the accumulated tensor's own backward would traverse every step.
    """

    id = "graph_retained_across_steps"
    maturity = "stable"
    Config = GraphRetainedConfig
    config: GraphRetainedConfig
    needs = frozenset({"loss_graph"})
    doc = CheckDoc(
        summary="Autograd graphs of earlier steps are still alive after their optimizer steps "
        "and their number grows: something keeps each step's loss tensor, graph and all.",
        why="Memory grows with every step (PyTorch's FAQ: 'accumulating history across your "
        "training loop'), the run slows and eventually runs out of memory, and the "
        "accumulated total still requires grad.",
        causes=(
            "`running_loss += loss` (or `total = total + loss`) for logging, instead of "
            "`loss.item()`.",
            "`losses.append(loss)` to average or plot later.",
            "A metrics dict or logger buffer that stores the loss tensor itself "
            "(`stats['loss'] += loss`, `history.append(d_loss)`).",
        ),
        fix="Keep numbers, not graphs: `running_loss += loss.item()` (or `loss.detach()` to "
        "stay on the device and sync later).",
        detail="autograd graphs of earlier steps are still alive after their optimizer steps, and "
        "more at each step (at least `min_retained`, 3): `running_loss += loss`, "
        "`losses.append(loss)`, a history dict of loss tensors. Told by a token in each scan "
        "step's root node's `metadata` (it lives as long as the node) and a weak reference to it; "
        "nothing is walked. `loss.item()`, `loss.detach()`, one step kept (`prev_loss = loss`) "
        "and gradient accumulation are fine. `details.retained`, `details.steps`, "
        "`details.backward_at`",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._alive: list[int] = []  # earlier graphs alive at the last scan steps

    def evidence(self) -> dict[str, int]:
        return {"loss_graph": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = graph_record(view)
        if rec is None:
            return
        alive = len(rec.retained)
        # growing: two more than a few steps ago (two optimizers close windows in turn)
        grew = bool(self._alive) and alive >= min(self._alive[-4:]) + 2
        self._alive = [*self._alive[-7:], alive]
        if alive < self.config.min_retained or not grew:
            return
        where = next((g.backward_at for g in rec.graphs if g.backward_at), None)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"The autograd graphs of {alive} earlier steps are still alive after their "
            "optimizer steps, one more at every step: something keeps each step's loss tensor "
            "(running_loss += loss, losses.append(loss)), and memory grows with the run.",
            hint="Accumulate numbers, not tensors with graphs: loss.item() (or loss.detach())"
            + (f"; the loss is backpropagated at {where}" if where else "")
            + ".",
            details={"retained": alive, "steps": sorted(rec.retained), "backward_at": where},
            params=upstream(view.index, rec.graphs[0], 0) if rec.graphs else [],  # the loss's
            key="retained",
        )
