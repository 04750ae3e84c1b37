"""The step pipeline: evidence of one optimizer step (or backward pass) → a StepView → checks.

Nothing here is a hook: the watcher calls :meth:`StepPipeline.decide` from the optimizer's
step hooks (or, without an optimizer, at the end of each backward pass).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from gradwatch.checks import Check, RunView, StepView, StructureView
from gradwatch.checks.nonfinite import NonfiniteGrad
from gradwatch.checks.not_observed import emit_not_observed
from gradwatch.config import GradWatchConfig
from gradwatch.core.distributed import DistSync
from gradwatch.core.evidence import Tracker
from gradwatch.core.faults import Faults
from gradwatch.core.findings import FindingLog
from gradwatch.core.hooks import HookSet
from gradwatch.core.index import ParamIndex
from gradwatch.core.pipeline import Gathered, Track, gather, layer_samples, merge_shards
from gradwatch.core.recorder import LayerRecorder
from gradwatch.core.scaler import ScalerWatch
from gradwatch.core.sharded import local_copies
from gradwatch.core.sharded_report import forward_arrival, late_sharding
from gradwatch.core.stats import flatten_cpu
from gradwatch.core.structure import Structure, group_signature
from gradwatch.core.unwatched import StepNesting, UnwatchedUpdates

__all__ = ["StepPipeline"]


class StepPipeline:
    """Turns each step's evidence into a :class:`StepView` and has the checks judge it."""

    def __init__(
        self,
        model: nn.Module,
        config: GradWatchConfig,
        structure: Structure,
        hooks: HookSet,
        checks: list[Check],
        findings: FindingLog,
        faults: Faults,
        scaler: ScalerWatch,
        recorder: LayerRecorder,
        dist: Optional[DistSync],
    ) -> None:
        self.model: Optional[nn.Module] = model
        self.config = config
        self.structure = structure
        self.tracker: Tracker = structure.tracker
        self.hooks = hooks
        self.checks = checks
        self.findings = findings
        self.faults = faults
        self.scaler = scaler
        self.recorder = recorder
        self.dist = dist
        self.steps = 0
        self.backward_passes = 0
        self.step_calls = 0  # outer optimizer steps entered (judged or not)
        self.nesting = StepNesting()
        self.unwatched = UnwatchedUpdates()
        self.sharded: Optional[str] = None  # the sharding engine (core/sharded.py), if any

    # -- layout ----------------------------------------------------------------------------

    def sync(self, step: int) -> None:
        """Re-read the layout; checks see it when it changed."""
        if self.model is None:
            return
        late_sharding(self.sharded, self.model, self.findings, self.config, step)
        view = self.structure.sync(self.model, self.hooks, step)
        for track in self.structure.tracks:
            track.sharded = self.sharded
        if view is not None:
            self._on_structure(view, step)

    def _on_structure(self, view: StructureView, step: int) -> None:
        for check in self.checks:
            self.faults.guard(f"{check.id} check", check.on_structure, view, self.findings)
        outside = self.structure.outside
        if outside:
            self.findings.emit(
                "param_outside_model",
                severity="info",
                step=step,
                message=f"{len(outside)} optimizer tensor(s) are not parameters of the watched "
                "model; watched under synthesized names.",
                hint="Watch the whole model (not a submodule) to get real parameter names.",
                params=self.structure.index.names(outside),
                key="optimizer",
            )

    # -- events ----------------------------------------------------------------------------

    def observed(self, track: Track) -> bool:
        return track.steps % self.config.every_n_steps == 0

    def backward_end(self) -> None:
        """A backward pass finished (queued by the first gradient that arrived in it)."""
        self.tracker.backward_queued = False
        self.backward_passes += 1
        if self.structure.lazy_materialised():
            self.sync(step=self.steps)
        if not self.structure.optimizers and self.structure.tracks:
            self.decide(self.structure.tracks[0])
        elif not self.nesting.inside():  # an LBFGS closure's backward belongs to its step
            self._look_for_unwatched_steps()

    def _look_for_unwatched_steps(self) -> None:
        for track in self.structure.tracks:
            if track.index is None or self.backward_passes - track.backward_at_start < 2:
                continue
            moved = self.unwatched.backward(track.index, track.params)
            if moved < 2:
                continue
            opt = self.structure.optimizers[track.index]
            emit_not_observed(
                self.findings,
                severity=self.config.check("not_observed").severity,
                step=track.steps,
                reason=f"optimizer_{track.index}_not_stepping",
                message=f"The parameters of watched optimizer {track.index} "
                f"({type(opt).__name__}) keep changing across backward passes, but its "
                f"step() has not run for {self.backward_passes - track.backward_at_start} "
                "passes: another optimizer object is training them, unwatched.",
                hint="Was the optimizer re-created mid-run? gradwatch watches the object passed "
                "to watch(): open a new watch() with the new optimizer (or pass all of them).",
                details={"optimizer": track.index, "backward_passes": moved},
            )

    def before_step(self, k: int) -> None:
        """Optimizer ``k`` is about to step: keep what the update ratio needs."""
        track = self.structure.track_of(k)
        if track is None or not self.observed(track) or not track.params:
            return
        if any(ParamIndex.uninitialized(p) for p in track.params):
            return  # no update ratio while a lazy parameter has no values yet
        with torch.no_grad():
            if track.sharded is not None:  # this rank's shards only, never a gather
                track.snapshot = local_copies(track.params)
                return
            track.snapshot_flat = flatten_cpu(track.params, copy=True)  # the CPU path
            if track.snapshot_flat is None:
                track.snapshot = list(torch._foreach_mul(track.params, 1.0))

    def after_step(self, k: int) -> None:
        """Optimizer ``k`` stepped: judge the window that ends here."""
        track = self.structure.track_of(k)
        if track is None:
            return
        if group_signature(self.structure.optimizers[k]) != track.signature:
            self.sync(step=track.steps)
            track = self.structure.track_of(k)
            assert track is not None
        self.unwatched.stepped(k, track.params)
        self.decide(track)

    # -- the decision ----------------------------------------------------------------------

    def decide(self, track: Track) -> None:
        """Gather the window's evidence, build its view, run the checks, close the window."""
        observed = self.observed(track)
        structure = self.structure
        if (structure._lazy and structure.lazy_materialised()) or (
            observed
            and track.steps > 0
            and self.model is not None
            and structure.may_have_changed(self.model)
        ):
            self.sync(step=track.steps)
            track = structure.track_of(track.index) or track
        with torch.profiler.record_function("gradwatch::step"), torch.no_grad():
            g = gather(
                track,
                self.tracker,
                observed=observed,
                min_hooked_at=self.hooks.hooked_at,
                last_hooked=self.hooks.last_hooked,
                scaler_scale=self.scaler.scale_tensor(),
                arrival=forward_arrival(self.sharded, structure.index, self.tracker, track.start),
            )
        self._note_skips(self.scaler.note(g.scale), track.steps)
        view = self._view(track, g, observed)
        for check in self.checks:
            self.faults.guard(f"{check.id} check", check.on_step, view, self.findings)
        if observed:
            several = sum(1 for t in structure.tracks if t.index is not None) > 1
            self.recorder.record(
                view,
                several_optimizers=several,
                findings=len(self.findings._findings),
                guard=self.faults.guard,
            )
        self.tracker.snapshot(g.ids, g.grads)
        if self.tracker.want_pre and self.hooks.trimmed:
            self.hooks.restore_pre_hooks(structure.index)
        track.snapshot = track.snapshot_flat = None
        track.start = self.tracker.now()
        track.backward_at_start = self.backward_passes
        track.steps += 1
        self.steps += 1
        self.faults.step = self.steps
        self._adjust_hooks()
        self.findings.raise_fail_fast()

    def _adjust_hooks(self) -> None:
        self.hooks.restore_wanted()
        limit = self.config.trim_hooks_after
        if (
            not self.hooks.trimmed
            and not self.hooks.keep_all
            and limit is not None
            and not self.config.fail_fast
            and self.steps >= limit
        ):
            flagged = {f.module for f in self.findings.findings() if f.check == "ghost_param"}
            self.hooks.trim({m for m in flagged if m is not None})

    def _view(self, track: Track, g: Gathered, observed: bool) -> StepView:
        index = self.structure.index
        tracker = self.tracker
        start = track.start
        wanted = self.hooks.wanted
        numel = [index.params[i].numel for i in g.ids] if observed else []

        def cause(i: int) -> str:
            info = index.params[i]
            if info.outside_model:
                return "unknown"
            since = tracker.fwd_since
            if not any(since.get(o, start + 1) <= start for o in info.owners):
                # Its forward hook was off (trimmed after trim_hooks_after) during this window.
                wanted.add(info.layer)
                return "unknown"
            if any(tracker.fwd_grad.get(o, 0) > start for o in info.owners):
                return "disconnected"
            if any(tracker.fwd_nograd.get(o, 0) > start for o in info.owners):
                return "no_grad"
            return "not_called"

        ranks = None
        ex = None
        if self.dist is not None:  # one all_gather: which rank missed what, and why
            device = track.params[0].device if track.params else None
            ex = self.dist.exchange(g.ids, g.arrived, cause, tracker, device, g.shard)
            ranks, g.arrived = ex.ranks_missing, ex.arrived
            if ex.payload is not None:  # sharded: per-rank shard sums -> global values
                merge_shards(g, ex.payload, observed, numel, tracker, index)
        return StepView(
            step=track.steps,
            optimizer=track.index,
            index=index,
            ids=g.ids,
            arrived=g.arrived,
            has_grad=g.has_grad,
            grad_norm=g.grad_norm,
            nonfinite=g.nonfinite,
            order=g.order,
            backward_in_window=self.backward_passes > track.backward_at_start,
            observed=observed,
            cause=ex.cause if ex is not None else cause,
            seen=[tracker.seen[i] for i in g.ids],
            missing=[tracker.missing[i] for i in g.ids],
            dirty=g.dirty,
            cleared=g.cleared,
            numel=numel,
            ranks_missing=ranks,
            world_size=self.dist.world_size if self.dist is not None else 1,
            scaler=self.scaler.scaler is not None,
            layers=layer_samples(g, numel, track) if observed else {},
            received=lambda i: tracker.last_seq[i] > 0,
        )

    # -- the scaler ------------------------------------------------------------------------

    def _note_skips(self, skipped: int, step: int) -> None:
        if not skipped:
            return
        for check in self.checks:
            if isinstance(check, NonfiniteGrad):
                check.on_skipped(skipped, self.scaler.skipped, step, self.findings)

    def check_scaler(self) -> None:
        """At exit: account for a skip of the very last step."""
        self._note_skips(self.scaler.note_current(), self.steps)

    def finish(self, faults: list[str]) -> None:
        """The run is over: checks judge it as a whole once."""
        if self.model is not None:  # a short run may never have re-read the layout
            late_sharding(self.sharded, self.model, self.findings, self.config, self.steps)
        tracker = self.tracker
        view = RunView(
            steps=self.steps,
            backward_passes=self.backward_passes,
            step_calls=self.step_calls,
            forward_ran=bool(tracker.fwd_first),
            forward_ran_with_grad=bool(tracker.fwd_grad),
            has_optimizer=bool(self.structure.optimizers),
            faults=faults,
        )
        for check in self.checks:
            self.faults.guard(f"{check.id} check", check.on_run, view, self.findings)

    def release(self) -> None:
        self.model = None
        self.nesting.clear()
        self.structure.release()
