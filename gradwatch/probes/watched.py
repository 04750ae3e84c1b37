"""The loss-free probes of ``watch()`` in the run: captured at the first forward, run once
after the step that consumed that batch (:mod:`gradwatch.probes.auto` does the probing).

- **When.** The first forward with grad enabled (one per watched model) keeps references to
  its inputs; at the end of the first optimizer step (or backward pass, without an
  optimizer) after it, that step waits once while the probes run on copies. The user's
  graph is gone by then, so nothing the probes do can reach it; the weights copied are the
  ones after that step (the properties probed hold for any weights).
- **What is never touched.** The probes work on deep copies; the global RNG state (torch
  CPU and CUDA, ``random``, NumPy) is restored (:func:`~gradwatch.probes._sandbox.rng_kept`);
  ``.grad``, the optimizer and the batch tensors are only read.
- **Distributed.** Rank 0 only, on its own batch: a copy is a plain module (no DDP wrapper,
  so no collective); a model with SyncBatchNorm (a collective in its forward) or sharded
  parameters (FSDP: a shard is not a model) is not probed, and the report says why.
- **Faults.** A probe that raises is a ``not_observed`` ``info`` of its own; a fault in this
  wiring goes through the watcher's ``Faults`` (``internal_error``), never into
  the user's step.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from torch import nn

from gradwatch.model.named import NamedModels
from gradwatch.probes.auto import FirstCall, refusal, run_auto, skipped
from gradwatch.results import Finding

__all__ = ["AutoProbes"]


class AutoProbes:
    """One watcher's loss-free probes: the first batch's capture, then one run."""

    def __init__(self, pipe: Any, faults: Any, wrappers: list[nn.Module]) -> None:
        """``pipe``: the watcher's step pipeline; ``faults``: its fault funnel (this layer
        sits below the run's, so both are duck-typed)."""
        self.pipe, self.faults, self.wrappers = pipe, faults, wrappers
        self.firsts: list[FirstCall] = []
        self.done = False
        pipe.after_decide.append(self.stepped)

    def install(self) -> None:
        """At attach: a first-call capture on each watched model (unless they are off)."""
        pipe = self.pipe
        if pipe.config.probes == "off" or (pipe.dist is not None and pipe.dist.rank != 0):
            self.done = True
            return
        if pipe.hooks.keep_all:  # torch.compile: a hook inside the graph breaks its tracing
            self.done = True
            return
        if pipe.sharded is not None:  # a shard cannot be copied: the layout says it already
            self.done = True
            return
        model = pipe.model
        assert model is not None
        named = model.names if isinstance(model, NamedModels) else [None]
        parts = [model.model(n) for n in model.names] if isinstance(model, NamedModels) else [model]
        on_error = self.faults.callback()
        pipe.hooks.removers.append(self._drop)  # at exit, with every hook: the batch and model
        for name, part in zip(named, parts):
            hooked = next((w for w in self.wrappers if getattr(w, "_orig_mod", None) is part), None)
            first = FirstCall.install(part, on_error, name, hooked)
            self.firsts.append(first)
            for handle in first.handles:
                pipe.hooks.add(handle)

    def _drop(self) -> None:
        for first in self.firsts:
            first.remove()
            first.release()
        self.firsts = []
        self.done = True

    def stepped(self) -> None:
        """After each judged step: the first one after a capture runs the probes, once."""
        if self.done or not any(f.done for f in self.firsts):
            return
        self.done = True
        self.faults.guard("loss-free probes", self._run)

    def _run(self) -> None:
        ready = [f for f in self.firsts if f.done]
        step_seconds = time.perf_counter() - min(f.started for f in ready)
        pipe = self.pipe
        try:
            for first in ready:
                why = refusal(first.model, pipe.config.probes)
                if why is not None:
                    self._emit(skipped(*why), first.name)
                    continue
                records, findings = run_auto(first, pipe.config, step_seconds)
                pipe.probes.extend(records)
                for finding in findings:
                    self._emit(finding, first.name)
        finally:
            self._drop()

    def _emit(self, finding: Finding, name: Optional[str]) -> None:
        """A probe's finding into the run's log (one per check, reason and model)."""
        pipe = self.pipe
        if not pipe.config.check(finding.check).enabled:
            return
        details: dict[str, Any] = dict(finding.details)
        what = ":".join(str(x) for x in (details.get("probe"), details.get("reason")) if x)
        what = what or finding.module or "probe"
        if name is not None:
            details["model"] = name
        pipe.findings.emit(
            finding.check,
            severity=finding.severity,
            step=max(pipe.steps - 1, 0),  # the step that consumed the batch
            message=finding.message,
            hint=finding.hint,
            params=list(finding.params) or None,
            module=finding.module,
            details=details,
            key=f"{name}:{what}" if name is not None else f"auto_probe:{what}",
        )
