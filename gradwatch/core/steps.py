"""The step pipeline: evidence of one optimizer step (or backward pass) → a StepView → checks.

Nothing here is a hook: the watcher calls :meth:`StepPipeline.decide` from the optimizer's
step hooks (or, without an optimizer, at the end of each backward pass).
"""

from __future__ import annotations

from types import FrameType
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.capture.facts import FOREIGN_TENSORS, Fact
from gradwatch.capture.forward.flow import layer_namer
from gradwatch.capture.forward.forward_scout import ForwardScout
from gradwatch.capture.grads.evidence import Tracker, make_cause
from gradwatch.capture.grads.hooks import HookSet
from gradwatch.capture.grads.in_backward import note_hand_written
from gradwatch.capture.grads.spans import pick
from gradwatch.capture.grads.step_reading import StepReading
from gradwatch.capture.grads.window import Gathered, Track
from gradwatch.capture.loop.scaler import ScalerWatch
from gradwatch.capture.loop.unwatched import StepNesting, UnwatchedUpdates
from gradwatch.checks import StepView, StructureView
from gradwatch.checks.views import ForwardOrder, WindowEvidence
from gradwatch.config import GradWatchConfig
from gradwatch.core.faults import Faults
from gradwatch.core.findings import FindingLog, Judges
from gradwatch.core.gather import gather, layer_samples
from gradwatch.core.layers import LayerRecorder
from gradwatch.core.structure import Structure, group_signature
from gradwatch.distributed.fsdp1_flat import FlatLayout, fingerprint_track
from gradwatch.distributed.gather import merge_shards
from gradwatch.distributed.layout import adopt_engine, forward_arrival
from gradwatch.distributed.sync import DistSync
from gradwatch.model.optimizers import GroupMap, compensates, group_members
from gradwatch.results import ProbeResult
from gradwatch.sources import SourceSet, StepState

__all__ = ["FIRST_OBSERVED", "StepPipeline", "open_window"]

# A run's first steps are all observed, whatever ``every_n_steps``: the statistics checks
# (patience 3) and ``nonfinite_param`` fire within about five steps, in a 5-step ``gradwatch
# check`` probe or a short fine-tune. The cadence holds after, and for the sinks throughout.
FIRST_OBSERVED = 5


class _Lookups:
    """One step's lookups of a watched parameter by id: its tensor, its param group and lr.

    Each map is built once, on first use (a check that asks for every stale layer's lr asked
    in O(parameters) each before: O(parameters**2) a step while the finding stood).
    """

    def __init__(self, track: Track) -> None:
        self.track = track
        self.opt = track.ref() if track.ref is not None else None
        self.groups = GroupMap(self.opt)
        self._pos: Optional[dict[int, int]] = None

    def read(self, i: int, fn: Callable[[Any, torch.Tensor], Any], default: Any) -> Any:
        """``fn(optimizer, tensor)`` for watched parameter ``i`` of the track's optimizer."""
        if self.track.ref is None:
            return default
        if self._pos is None:
            self._pos = {j: k for k, j in reversed(list(enumerate(self.track.ids)))}
        k = self._pos.get(i)
        return default if k is None else fn(self.opt, self.track.params[k])


def _on_cadence(pipe: StepPipeline, track: Track) -> bool:
    """A step of the statistics cadence (``every_n_steps``): the sinks' metrics are recorded."""
    return track.steps % pipe.config.every_n_steps == 0


class StepPipeline:
    """Turns each step's evidence into a :class:`StepView` and has the checks judge it."""

    def __init__(
        self,
        model: nn.Module,
        config: GradWatchConfig,
        structure: Structure,
        hooks: HookSet,
        judges: Judges,
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
        self.judges = judges
        self.findings = findings
        self.faults = faults
        self.scaler = scaler
        self.recorder = recorder
        self.dist = dist
        self.steps = 0
        self.backward_passes = 0
        wanted = judges.evidence()  # what the enabled checks need, with their settings
        self.scout = ForwardScout(
            self.tracker, faults.callback(), int(wanted.get("module_scan", 0))
        )
        self.sources = SourceSet(self, wanted)
        self.step_calls = 0  # outer optimizer steps entered (judged or not)
        self.hand_written = 0  # steps that found gradients no backward pass made
        self.nesting = StepNesting()
        self.unwatched = UnwatchedUpdates()
        self.sharded: Optional[str] = None  # the sharding engine (distributed/sharded.py), if any
        self.reading = StepReading(self.tracker, hooks)
        self.flat = FlatLayout()  # FSDP1 flattened: the originals read from each flat shard
        self.tracker.layer_of = layer_namer(structure.index)  # the forward's data flow
        self.after_decide: list[Callable[[], None]] = []  # the loss-free probes' trigger
        self.probes: list[ProbeResult] = []  # their records, for the report

    # -- layout ----------------------------------------------------------------------------

    def sync(self, step: int) -> None:
        """Re-read the layout; checks see it when it changed."""
        if self.model is None:
            return
        view = self.structure.sync(self.model, self.hooks, step)
        adopt_engine(self, step)
        self.sources.install()
        if view is not None:
            self._on_structure(view, step)

    def record(self, fact: Fact) -> None:
        """A fact the run saw: the checks that judge its kind do."""
        self.judges.fact(fact)

    def _record(self, fact: Optional[Fact]) -> None:
        if fact is not None:
            self.judges.fact(fact)

    def needing(self, need: str) -> list[str]:
        """The ids of the enabled checks that need ``need`` (for the sources' messages)."""
        return self.judges.needing(need)

    def _on_structure(self, view: StructureView, step: int) -> None:
        self.judges.structure(view)
        outside = self.structure.outside
        if outside:
            self.record(
                Fact(
                    FOREIGN_TENSORS,
                    step=step,
                    key="optimizer",
                    message=f"{len(outside)} optimizer tensor(s) are not parameters of the "
                    "watched model; watched under synthesized names.",
                    hint="Watch the whole model the optimizer trains; if you do, these are "
                    "layers replaced after the optimizer was built (see ghost_param).",
                    params=self.structure.index.names(outside),
                )
            )

    # -- events ----------------------------------------------------------------------------

    def observed(self, track: Track) -> bool:
        return track.steps < FIRST_OBSERVED or _on_cadence(self, track)

    def backward_end(self) -> None:
        """A backward pass finished (queued by the first gradient that arrived in it)."""
        self.tracker.backward_queued = False
        self.backward_passes += 1
        if self.structure.lazy_materialised():
            self.sync(step=self.steps)
        if not self.structure.optimizers and self.structure.tracks:
            self.decide(self.structure.tracks[0])
        elif not self.nesting.inside():  # an LBFGS closure's backward belongs to its step
            for track in self.structure.tracks:
                if track.index is not None:
                    self.unwatched.look(track, self.backward_passes, self.structure, self.record)

    def step_pre(self, k: int, caller: FrameType) -> None:
        """Optimizer ``k``'s pre-step hook (a nested ``super().step()`` is the same step)."""
        if self.nesting.enter(k, caller):
            self.before_step(k)

    def step_post(self, k: int) -> bool:
        """Optimizer ``k``'s post-step hook; whether an outer step was judged."""
        if not self.nesting.leave(k):
            return False
        self.step_calls += 1
        self.after_step(k)
        return True

    def before_step(self, k: int) -> None:
        """Optimizer ``k`` is about to step: keep what the update ratio needs."""
        track = self.structure.track_of(k)
        if track is not None and self.observed(track):
            model = self.model
            if track.steps and model is not None and self.structure.may_have_changed(model):
                self.sync(step=track.steps)  # frozen step by step: today's frozen set moves
                track = self.structure.track_of(k) or track
            fingerprint_track(track)

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
        for other in self.structure.tracks:
            if other.index is not None and other.index != k:
                self.unwatched.explained(other.index, other.params)
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
        readable = self.reading.before_gather(self, track)
        with torch.profiler.record_function("gradwatch::step"), torch.no_grad():
            g = gather(
                track,
                self.tracker,
                observed=observed,
                min_hooked_at=self.hooks.hooked_at,
                last_hooked=self.hooks.last_hooked,
                scaler_scale=self.scaler.scale_tensor(),
                arrival=forward_arrival(self.sharded, structure.index, self.tracker, track.start),
                extra=self.sources.device_values(track),
                read=self.reading.take_grads(),
            )
        state = StepState(track, g)
        self.sources.read(state, g.extra)
        self.reading.after_gather(g, track, readable, structure.tracks)
        state.skipped = skipped = self.scaler.note(g.scale)
        self._record(self.scaler.skip_fact(skipped, track.steps, state.trace))
        if note_hand_written(self.tracker, track, g, self.backward_passes, exact=self.dist is None):
            self.hand_written += 1
        fields, records = self.sources.window(state)
        view = _step_view(self, track, g, observed, WindowEvidence(**fields, records=records))
        self.judges.step(view)
        if observed and _on_cadence(self, track):
            several = sum(1 for t in structure.tracks if t.index is not None) > 1
            self.recorder.record(
                view,
                several_optimizers=several,
                findings=len(self.findings),
                guard=self.faults.guard,
            )
        self.tracker.snapshot(g.ids, g.grads, self.reading.arrived_now, (track.ids, track.params))
        if self.tracker.want_pre and self.hooks.trimmed:
            self.hooks.restore_pre_hooks(structure.index)
        track.fingerprint = track.frozen_fp = None
        track.start = self.tracker.now()
        track.backward_at_start = self.backward_passes
        self.sources.window_closed(track.index)
        track.steps += 1
        self.steps += 1
        self.sources.after_step(self.steps)
        self.faults.step = self.steps
        _adjust_hooks(self)
        for then in self.after_decide:
            then()
        self.findings.raise_fail_fast()

    # -- the scaler ------------------------------------------------------------------------

    def check_scaler(self) -> None:
        """At exit: account for a skip of the very last step."""
        skipped = self.scaler.note_current()
        self._record(self.scaler.skip_fact(skipped, self.steps, self.sources.at_exit(skipped)))

    def release(self) -> None:
        self.model = None
        self.nesting.clear()
        self.structure.release()


def _step_view(
    self: StepPipeline, track: Track, g: Gathered, observed: bool, window: WindowEvidence
) -> StepView:
    """The step's view, built once: the gathered reads, the ranks' exchange, the window."""
    index = self.structure.index
    tracker = self.tracker
    look = _Lookups(track)
    start = track.start
    wanted = self.hooks.wanted
    numel = [p.numel for p in pick(index.params, g.ids)] if observed else []
    cause = make_cause(index, tracker, start, wanted)

    ranks = None
    ex = None
    if self.dist is not None:  # one all_gather: which rank missed what, and why
        device = track.params[0].device if track.params else None
        ex = self.dist.exchange(
            g.ids, g.arrived, cause, tracker, device, g.shard, track.steps, track
        )
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
        seen=pick(tracker.seen, g.ids),
        missing=pick(tracker.missing, g.ids),
        dirty=g.dirty,
        cleared=g.cleared,
        written=g.written,
        numel=numel,
        ranks_missing=ranks,
        world_size=self.dist.world_size if self.dist is not None else 1,
        scaler=self.scaler.scaler is not None,
        layers=layer_samples(g, numel, track) if observed else {},
        received=lambda i: tracker.last_seq[i] > 0,
        frozen_changed=g.frozen_changed,
        group_lr=lambda i: look.read(i, lambda _, t: look.groups.lr(t), None),
        group_of=lambda i: look.read(i, lambda _, t: look.groups.index(t), None),
        group_ids=lambda g: group_members(track.ref() if track.ref else None, g, index.lookup),
        moved_frac=g.stats.get("moved_frac") if g.stats is not None else None,
        compensated=lambda i: look.read(i, compensates, False),
        forward=ForwardOrder(tracker.fwd_grad, tracker.links),
        window=window,
    )


def _adjust_hooks(pipe: StepPipeline) -> None:
    """Forward hooks back where a step asked for them; trim after ``trim_hooks_after``."""
    pipe.hooks.restore_wanted()
    limit = pipe.config.trim_hooks_after
    if (
        not pipe.hooks.trimmed
        and not pipe.hooks.keep_all
        and limit is not None
        and not pipe.config.fail_fast
        and pipe.steps >= limit
    ):
        pipe.hooks.trim(pipe.judges.hooked_modules(pipe.findings.findings()))


def open_window(pipe: StepPipeline, k: int) -> None:
    """The first step of an optimizer added mid-run: counted, not judged; its window opens."""
    pipe.step_calls += 1
    track = pipe.structure.track_of(k)
    if track is None:
        return
    pipe.tracker.snapshot(track.ids, [p.grad for p in track.params])
    pipe.unwatched.stepped(k, track.params)
    track.fingerprint = track.frozen_fp = None
    track.start = pipe.tracker.now()
    track.backward_at_start = pipe.backward_passes
    pipe.sources.window_closed(k)
    track.steps += 1
    pipe.steps += 1
