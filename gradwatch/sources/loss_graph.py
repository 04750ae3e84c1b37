"""The loss and the forward as computed (``loss_graph``): on scan steps, a compact description
of each backward's graph (:class:`~gradwatch.capture.loss.graph_walk.GraphDesc`: node kinds,
output shapes, saved settings such as a softmax's dim or a loss's reduction, which module
produced which node and in which mode, the terms of a summed loss), and the earlier steps
whose graphs are still alive.

Checks read it as ``view.window.records["loss_graph"]`` (a :class:`LossGraphRecord`), on
the first ``scan_steps`` steps only (the largest any enabled check asks for); other steps
have no record and cost nothing. Under torch.compile the model's inside is one opaque node
and no module is named: the checks that need it are told ``not_observed`` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.grads.window import Track
from gradwatch.capture.loss.graph_walk import GraphDesc
from gradwatch.capture.loss.loss_graphs import LossGraphs
from gradwatch.capture.loss.term_shares import TermInfo
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["LossGraphRecord", "LossGraphSource"]


@dataclass
class LossGraphRecord:
    """What one scan step's window showed of its losses' graphs."""

    graphs: list[GraphDesc] = field(default_factory=list)
    """Each backward of the window (gradient accumulation: several), root first."""
    retained: list[int] = field(default_factory=list)
    """The earlier windows whose described graphs are still alive at this step."""
    window: int = 0
    """Windows closed before this one (0: the first step)."""
    terms: Optional[tuple[list[TermInfo], list[float]]] = None
    """A summed loss's terms and the norm of the gradient each sent into the values the
    terms share (``loss_terms``), or ``None``."""


class LossGraphSource(EvidenceSource):
    name = "loss_graph"
    serves = frozenset({"loss_graph", "loss_terms"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.graphs: Optional[LossGraphs] = None
        self._told_compiled = False
        self._values: list[float] = []

    def install(self) -> None:
        ctx = self.ctx
        steps = max(int(self.wanted.get(k, 0)) for k in ("loss_graph", "loss_terms"))
        if self.graphs is not None or ctx.model is None or steps <= 0:
            return
        self.graphs = LossGraphs(
            ctx.model,
            ctx.faults.callback(),
            scan_steps=steps,
            observe_modules=not ctx.hooks.keep_all,
            terms=int(self.wanted.get("loss_terms", 0)) > 0,
        )
        if ctx.hooks.keep_all:
            self._compiled("the model runs under torch.compile")

    def device_values(self, track: Track) -> list[Any]:
        g = self.graphs
        return g.shares.values() if g is not None and g.shares is not None else []

    def read(self, state: StepState, values: list[float]) -> None:
        self._values = values

    def record(self, state: StepState) -> Optional[LossGraphRecord]:
        g = self.graphs
        if g is None or not g.scanning:
            return None
        graphs = g.take()
        if any(d.compiled for d in graphs):
            self._compiled("the loss's graph holds a compiled region (torch.compile)")
        values, self._values = self._values, []
        terms = g.shares.take(values) if g.shares is not None else None
        return LossGraphRecord(graphs, g.retained(), g.window, terms)

    def _compiled(self, why: str) -> None:
        if self._told_compiled:
            return
        self._told_compiled = True
        checks = self.ctx.needing("loss_graph")
        self.ctx.record(
            Fact(
                UNOBSERVABLE,
                step=self.ctx.steps,
                key="compiled_loss_graph",
                message=f"{why}: its inside is one opaque node of the loss's graph, and no "
                f"module is named, so {', '.join(checks)} see only the ops outside it "
                "(a softmax, a broadcast or a dropout inside the compiled model is not seen).",
                hint="Run a few steps without torch.compile (or `gradwatch check` on the "
                "eager model) to cover these checks.",
                # a partial blind spot, as the scout's: said, and the run still passes
                details={"reason": "compiled_forward", "part": "loss_graph", "checks": checks},
            )
        )

    def window_closed(self, k: Optional[int]) -> None:
        if self.graphs is not None:
            self.graphs.window_closed()

    def remove(self) -> None:
        if self.graphs is not None:
            self.graphs.remove()
            self.graphs = None
