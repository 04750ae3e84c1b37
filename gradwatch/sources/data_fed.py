"""``data_as_fed``: the watched model's batches as fed, on a sample of steps
(:mod:`gradwatch.capture.forward.data_fed`).

Every step of the first ``scan_steps`` is read, then every 2nd step up to twice that, every
4th up to 4 times, and so on (about ``scan_steps / 2`` reads per doubling of the run). A train-mode
forward's prints join a bounded set of trained samples; the step's train forwards are its
record (``view.window.records["data_as_fed"]``, a :class:`DataFedRecord`). An eval-mode
forward (the first ``eval_forwards`` of them, whenever they run) becomes a ``fed_eval``
fact: how many of its samples were trained on. Under torch.compile nothing is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gradwatch.capture.facts import FED_EVAL, Fact
from gradwatch.capture.forward.data_fed import DataFedWatch, Fed
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["DataFedRecord", "DataFedSource", "sampled"]

_TRAINED_MAX = 1 << 18  # sample prints kept (8 bytes each)
_EVAL_FORWARDS = 64


@dataclass
class DataFedRecord:
    """One read step's train-mode forwards, and the first layer that reads the input."""

    fed: list[Fed] = field(default_factory=list)
    first: Optional[tuple[str, list[str], bool]] = None


def sampled(step: int, scan: int) -> bool:
    """Whether step ``step`` (0-based) is read."""
    if step < scan:
        return True
    if scan <= 0:
        return False
    return step % (2 << ((step // scan).bit_length() - 1)) == 0


class DataFedSource(EvidenceSource):
    name = "data_as_fed"
    serves = frozenset({"data_as_fed"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.watch: Optional[DataFedWatch] = None
        self.trained: set[int] = set()
        self._pending: list[Fed] = []
        self._scan = int(wanted.get("data_as_fed", 0))
        self._done = False
        self._last: set[int] = set()  # the last train batch's prints

    def install(self) -> None:
        ctx = self.ctx
        if self._done or ctx.model is None or self._scan <= 0 or ctx.hooks.keep_all:
            return
        self._done = True
        self.watch = DataFedWatch(ctx.model, self._fed, ctx.faults.callback(), _EVAL_FORWARDS)
        self.watch.active = sampled(ctx.steps, self._scan)

    def _fed(self, fed: Fed) -> None:
        if fed.training:
            self._pending.append(fed)
            self._last = set(fed.prints)
            if len(self.trained) < _TRAINED_MAX:
                self.trained.update(fed.prints)
            return
        if not self.trained or not fed.prints:
            return
        seen = sum(1 for p in fed.prints if p in self.trained)
        first = self.watch.first if self.watch is not None else None
        self.ctx.record(
            Fact(
                FED_EVAL,
                step=self.ctx.steps,
                key=str(self.ctx.steps),
                message="",
                params=first[1] if first else None,
                details={
                    "samples": len(fed.prints),
                    "trained": seen,
                    "last_batch": set(fed.prints) <= self._last,
                    "module": first[0] if first else None,
                },
            )
        )

    def record(self, state: StepState) -> Optional[DataFedRecord]:
        fed, self._pending = self._pending, []
        if not fed or self.watch is None:
            return None
        return DataFedRecord(fed, self.watch.first)

    def after_step(self, steps: int) -> None:
        if self.watch is not None:
            self.watch.active = sampled(steps, self._scan)

    def remove(self) -> None:
        if self.watch is not None:
            self.watch.remove()
            self.watch = None
