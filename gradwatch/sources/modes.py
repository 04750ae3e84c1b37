"""The model's modes at its training forwards, and freezing flags PyTorch ignores.

``module_modes`` (``eval_mode_training``, ``frozen_stats_updated``): which mode-dependent
modules ran in eval (or train) mode at the window's latest training forward, seen at each
outermost forward in grad mode through the shared scout. ``module_flags``
(``freeze_not_applied``): attributes such as ``module.requires_grad = False`` that freeze
nothing.
"""

from __future__ import annotations

from typing import Any

from gradwatch.capture.forward.modes import ModeWatch
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["ModesSource"]


class ModesSource(EvidenceSource):
    name = "modes"
    serves = frozenset({"module_modes", "module_flags"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.modes = ModeWatch(ctx.tracker)
        self.modes.calls.on_error = ctx.faults.callback()
        self._linked = False

    def wants_scout(self) -> bool:
        return "module_modes" in self.wanted

    def blind_when_compiled(self) -> list[str]:
        return self.ctx.needing("module_modes")

    def install(self) -> None:
        """At every layout sync: the mode-dependent modules of the trainable model."""
        ctx = self.ctx
        if ctx.model is None:
            return
        idx = ctx.structure.index
        self.modes.collect(ctx.model, lambda p: p.requires_grad and idx.lookup(p) is not None)
        if not self._linked and "module_modes" in self.wanted and ctx.scout.installed:
            self._linked = True
            ctx.scout.on_outer = self.modes.seen

    def window(self, state: StepState) -> dict[str, Any]:
        assert state.track is not None
        return {"modes": self.modes.take(state.track.start), "freeze_flags": self.modes.flags}

    def remove(self) -> None:
        self.modes.remove()
