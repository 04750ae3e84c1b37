"""The forward as the model's entry hooks see it: when it ran, unregistered modules, NaN births.

One source over the :class:`~gradwatch.capture.forward.forward_scout.ForwardScout` the run shares:
``forward_runs`` (the model ran in the window, in which grad mode), ``module_scan``
(modules run but not registered, the first ``scan_steps`` steps) and ``nan_probe`` (per-module
finiteness flags while armed, read with the step's transfer).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.grads.window import Track
from gradwatch.measure.stats import to_host
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["FIRST_TRACE_STEPS", "ForwardSource"]

FIRST_TRACE_STEPS = 3  # steps the NaN probe is on from the start (then only after a NaN)


class ForwardSource(EvidenceSource):
    name = "forward"
    serves = frozenset({"forward_runs", "module_scan", "nan_probe"})
    always = True  # the run stamps: whether the model ran in a window at all

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.scout = ctx.scout
        self._armed_once = False

    def wants_scout(self) -> bool:
        return "forward_runs" in self.wanted or self.scout.scanning or "nan_probe" in self.wanted

    def blind_when_compiled(self) -> list[str]:
        needing = self.ctx.needing
        blind = [*needing("forward_runs"), *(needing("module_scan") if self.scout.scanning else [])]
        if "nan_probe" in self.wanted:
            blind += [
                f"{c}'s forward origin (details.phase/origin_module)" for c in needing("nan_probe")
            ]
        return blind

    def install(self) -> None:
        """Once the scout is in place: the NaN probe is on for the first steps (a NaN of the
        first batches is traced at once, before the update spreads it into the weights); a
        flag per module call is the costliest hook, so at most FIRST_TRACE_STEPS steps."""
        if self._armed_once or not self.scout.installed or self.wanted.get("nan_probe", 0) <= 0:
            return
        self._armed_once = True
        limit = self.ctx.config.trim_hooks_after
        self.scout.arm(10**9 if limit is None else min(limit, FIRST_TRACE_STEPS))

    def device_values(self, track: Track) -> list[torch.Tensor]:
        return self.scout.pending_flags()

    def read(self, state: StepState, values: list[float]) -> None:
        if self.scout.armed:
            state.trace = self.scout.interpret(values)

    def window(self, state: StepState) -> dict[str, Any]:
        """The run stamps and unregistered parameters; (dis)arms the NaN probe."""
        assert state.track is not None and state.gathered is not None
        start, scout = state.track.start, self.scout
        model_ran: Optional[str] = None
        if scout.ran_grad > start:
            model_ran = "grad"
        elif scout.ran_nograd > start:
            model_ran = "no_grad"
        # A step the GradScaler skipped had inf/NaN gradients too: trace those as well.
        nonfinite = any(state.gathered.nonfinite) or state.skipped > 0
        nan_trace = None
        if scout.armed:
            scout.armed_steps += 1
            if nonfinite:
                nan_trace = state.trace
            if (nonfinite and state.trace is not None) or scout.armed_steps >= scout.arm_limit:
                scout.disarm()
        elif nonfinite and "nan_probe" in self.wanted:
            scout.arm(self.wanted["nan_probe"])
        return {
            "model_ran": model_ran,
            "unregistered": scout.take_unregistered(),
            "nan_trace": nan_trace,
        }

    def after_step(self, steps: int) -> None:
        self.scout.after_step(steps)

    def at_exit(self, state: StepState) -> None:
        """A last step the scaler skipped: read the probe now (no step waits for it)."""
        if not state.skipped or not self.scout.armed:
            return
        flags = self.scout.pending_flags()
        state.trace = self.scout.interpret(to_host(flags) if flags else [])


def compiled_fact(ctx: SourceContext, blind: list[str]) -> Fact:
    """Under torch.compile the scout stays off: which checks that leaves blind."""
    return Fact(
        UNOBSERVABLE,
        step=0,
        key="compiled_forward",
        message="The model runs under torch.compile, where gradwatch adds no forward "
        f"hooks of its own (each would be a recompile): {', '.join(blind)} "
        "cannot be checked. Ghost parameters, gradient statistics and the other "
        "checks run as usual.",
        hint="Run a few steps without torch.compile (or `gradwatch check` on the eager "
        "model) to cover these checks.",
        details={"reason": "compiled_forward", "part": "forward_hooks", "checks": blind},
    )
