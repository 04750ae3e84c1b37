"""The run's evidence sources: those the enabled checks need, looped over at each step.

The step pipeline (``gradwatch.core.steps``) calls, in this order: :meth:`SourceSet.install`
at each layout sync, :meth:`~SourceSet.device_values` before the step's one host transfer
(each source's values are a named slice of it), :meth:`~SourceSet.read` after it,
:meth:`~SourceSet.window` to build the step's ``WindowEvidence``, then
:meth:`~SourceSet.window_closed` and :meth:`~SourceSet.after_step`. Every call into a source
goes through the run's fault guard.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch

from gradwatch.capture.grads.window import Track
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState
from gradwatch.sources.forward import compiled_fact
from gradwatch.sources.registry import ALL_SOURCES, NEEDS, unknown_needs

__all__ = ["SourceSet"]

S = TypeVar("S", bound=EvidenceSource)


def _overriding(sources: list[EvidenceSource], *methods: str) -> list[EvidenceSource]:
    """The ``sources`` that define one of ``methods`` over the base's no-op, in order."""
    return [
        s
        for s in sources
        if any(getattr(type(s), m) is not getattr(EvidenceSource, m) for m in methods)
    ]


class SourceSet:
    """The sources of one run, built from what the enabled checks need."""

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        unknown_needs(wanted, "an enabled check's evidence()")
        self.ctx = ctx
        self.wanted = wanted
        self.sources: list[EvidenceSource] = []
        for cls in ALL_SOURCES:
            mine = {k: v for k, v in wanted.items() if k in cls.serves}
            if mine or cls.always:
                self.sources.append(cls(ctx, mine))
        self._slices: dict[str, int] = {}  # source name -> its count of transfer values
        self._scout_installed = False
        for src in self.sources:
            ctx.hooks.removers.append(src.remove)
        # Per step method, the sources that have one of their own: most have only some
        # (a step would otherwise make about 140 calls, 100 of them to the base's no-ops).
        # A source with device values is handed its slice (``read``) to keep the slices in
        # order; ``window`` and ``record`` are called one source after the other.
        srcs = self.sources
        self._with = {
            "device_values": _overriding(srcs, "device_values"),
            "read": _overriding(srcs, "read", "device_values"),
            "window": _overriding(srcs, "window", "record"),
            "window_closed": _overriding(srcs, "window_closed"),
            "after_step": _overriding(srcs, "after_step"),
        }

    def wants(self, need: str) -> bool:
        """Whether an enabled check needs ``need``."""
        return need in self.wanted

    def get(self, kind: type[S]) -> Optional[S]:
        """The run's source of class ``kind``, if one was built."""
        return next((s for s in self.sources if isinstance(s, kind)), None)

    def serving(self, need: str) -> Optional[EvidenceSource]:
        """The built source that serves ``need``, if any."""
        cls = NEEDS.get(need)
        return self.get(cls) if cls is not None else None

    def install(self) -> None:
        """At each layout sync: the scout once (where a source wants it), then every source."""
        ctx = self.ctx
        guard = ctx.faults.guard
        if not self._scout_installed and ctx.model is not None:
            self._scout_installed = True
            self._install_scout()
        for src in self.sources:
            guard(f"{src.name} evidence", src.install)

    def _install_scout(self) -> None:
        """Under torch.compile no hook may come or go (each is a dynamo guard: a recompile),
        and the scout's come and go by design: a compiled model gets none of them."""
        ctx = self.ctx
        if not any(s.wants_scout() for s in self.sources):
            return
        if ctx.hooks.keep_all:
            blind = [c for s in self.sources if s.wants_scout() for c in s.blind_when_compiled()]
            if blind:
                ctx.record(compiled_fact(ctx, blind))
            return
        index = ctx.structure.index
        assert ctx.model is not None
        ctx.scout.install(ctx.model, lambda p: index.lookup(p) is not None)
        ctx.hooks.removers.append(ctx.scout.remove_all)

    def device_values(self, track: Track) -> list[torch.Tensor]:
        """Every source's device values for the step's transfer, slice after slice."""
        out: list[torch.Tensor] = []
        self._slices = {}
        for src in self._with["device_values"]:
            values = src.device_values(track)
            if values:
                self._slices[src.name] = sum(v.numel() for v in values)  # read flattened
                out.extend(values)
        return out

    def read(self, state: StepState, values: list[float]) -> None:
        """Hand each source its slice of the transfer."""
        at = 0
        slices = self._slices
        for src in self._with["read"]:
            n = slices.get(src.name, 0)
            mine = values[at : at + n]
            at += n
            state.read[src.name] = mine
            src.read(state, mine)

    def window(self, state: StepState) -> tuple[dict[str, Any], dict[str, Any]]:
        """The fields of the step's ``WindowEvidence`` and the sources' own records."""
        fields: dict[str, Any] = {}
        records: dict[str, Any] = {}
        for src in self._with["window"]:
            fields.update(src.window(state))
            rec = src.record(state)
            if rec is not None:
                records[src.name] = rec
        return fields, records

    def window_closed(self, k: Optional[int]) -> None:
        for src in self._with["window_closed"]:
            src.window_closed(k)

    def after_step(self, steps: int) -> None:
        for src in self._with["after_step"]:
            src.after_step(steps)

    def at_exit(self, skipped: int) -> Optional[dict[str, Any]]:
        """The run ends: what the sources read without a step (the NaN probe's last trace)."""
        state = StepState(track=None, gathered=None, skipped=skipped)
        for src in self.sources:
            src.at_exit(state)
        return state.trace
