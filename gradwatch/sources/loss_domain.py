"""``loss_inputs``: every torch loss call of a scan step, with the reductions that say whether
its inputs and targets lie in the loss's documented domain
(:mod:`gradwatch.capture.loss.loss_domain`, :mod:`gradwatch.capture.loss.domains`).

Checks read it as ``view.window.records["loss_domain"]`` (a :class:`LossDomainRecord`) on
the first ``scan_steps`` steps; other steps have no record and cost nothing. Under
torch.compile nothing is pushed (a mode is a dynamo guard): the checks that need it are
told ``not_observed`` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.grads.window import Track
from gradwatch.capture.loss.loss_domain import LossCall, LossDomain
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["LossDomainRecord", "LossDomainSource"]


@dataclass
class LossDomainRecord:
    """What one scan step's window showed of its loss calls."""

    calls: list[LossCall] = field(default_factory=list)
    roots: list[float] = field(default_factory=list)  # each backward's root value, in order


class LossDomainSource(EvidenceSource):
    name = "loss_domain"
    serves = frozenset({"loss_inputs"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.domain: Optional[LossDomain] = None
        self._values: list[float] = []

    def install(self) -> None:
        ctx = self.ctx
        steps = int(self.wanted.get("loss_inputs", 0))
        if self.domain is not None or ctx.model is None or steps <= 0:
            return
        if ctx.hooks.keep_all:
            self._compiled()
            return
        self.domain = LossDomain(ctx.model, ctx.faults.callback(), scan_steps=steps)

    def device_values(self, track: Track) -> list[Any]:
        return self.domain.values() if self.domain is not None else []

    def read(self, state: StepState, values: list[float]) -> None:
        self._values = values

    def record(self, state: StepState) -> Optional[LossDomainRecord]:
        if self.domain is None:
            return None
        values, self._values = self._values, []
        calls = self.domain.take(values)
        for call in calls:
            self._name(call)
        return LossDomainRecord(calls, list(self.domain.roots)) if calls else None

    def _name(self, call: LossCall) -> None:
        """The watched parameters upstream of the loss's input, and the nearest one's module."""
        index = self.ctx.structure.index
        idxs: list[int] = []
        for ref in call.leaves:
            p = ref()
            i = index.lookup(p) if p is not None else None
            if i is not None and i not in idxs:
                idxs.append(i)
        call.leaves = []
        if idxs:
            call.params = index.names(idxs)
            first = call.params[0]
            call.producer = first.rsplit(".", 1)[0] if "." in first else None

    def _compiled(self) -> None:
        checks = self.ctx.needing("loss_inputs")
        self.ctx.record(
            Fact(
                UNOBSERVABLE,
                step=self.ctx.steps,
                key="compiled_loss_inputs",
                message="the model runs under torch.compile: its loss calls are not read, so "
                f"{', '.join(checks)} did not judge the losses' inputs.",
                hint="Run a few steps without torch.compile (or `gradwatch check` on the "
                "eager model) to cover these checks.",
                details={"reason": "compiled_forward", "part": "loss_inputs", "checks": checks},
            )
        )

    def window_closed(self, k: Optional[int]) -> None:
        if self.domain is not None:
            self.domain.window_closed()

    def remove(self) -> None:
        if self.domain is not None:
            self.domain.remove()
            self.domain = None
