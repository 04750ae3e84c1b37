"""Evidence beyond each step's gradients, gathered only where an enabled check needs it.

The checks declare what they need (``Check.needs`` / ``Check.evidence()``): the forward
scout's run stamps (``forward_runs``) and scan for unregistered modules (``module_scan``),
the NaN probe (``nan_probe``), the GradScaler's unscale watch (``unscale_watch``). Backward
requests an integration reports, and what each step consumed, are filled into the
:class:`~gradwatch.checks.StepView` before the checks run.
"""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.capture.autocast_probe import AutocastProbe
from gradwatch.capture.discarded import discarded_passes
from gradwatch.capture.double_backward import BackwardProbe
from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.forward_scout import ForwardScout
from gradwatch.capture.loose import BackwardRoots
from gradwatch.capture.modes import ModeWatch
from gradwatch.capture.schedulers import SchedulerCounts
from gradwatch.capture.unscale_watch import UnscaleWatch
from gradwatch.capture.window import Gathered, Track
from gradwatch.capture.zero_grad_watch import AfterStepEdits, ZeroGradWatch
from gradwatch.checks.views import WindowEvidence
from gradwatch.distributed.replicas import ReplicaCheck
from gradwatch.measure.stats import to_host

__all__ = ["FIRST_TRACE_STEPS", "ExtraEvidence"]

FIRST_TRACE_STEPS = 3  # steps the NaN probe is on from the start (then only after a NaN)


class ExtraEvidence:
    """The second-round checks' evidence of one pipeline."""

    def __init__(self, pipe: Any) -> None:  # the StepPipeline (typed loosely: no import circle)
        self.pipe = pipe
        self.config = pipe.config
        self.tracker = pipe.tracker
        self.wanted: dict[str, Any] = pipe.judges.evidence()  # what the enabled checks need
        self.scout = ForwardScout(
            self.tracker, pipe.faults.callback(), int(self.wanted.get("module_scan", 0))
        )
        self._unscale: Optional[UnscaleWatch] = None
        self._newer_installed = False
        self.scaled_edits: dict[Optional[int], list[int]] = {}
        self.backward_calls: Optional[int] = None  # counted only where an integration sees them
        self._calls_at_start: dict[Optional[int], int] = {}
        self.after_step: Optional[AfterStepEdits] = None  # clip_after_step's evidence
        self.zero_watch: Optional[ZeroGradWatch] = None
        self.schedulers = SchedulerCounts() if "scheduler_counts" in self.wanted else None
        self.probe: Optional[BackwardProbe] = None  # double_backward's evidence
        if "backward_probe" in self.wanted:
            self.probe = BackwardProbe(lambda: self.scout.ran_grad)
            pipe.hooks.removers.append(self.probe.remove)
        self.repeated = 0  # the step being decided: backward passes that repeated another
        # The model's modes at training forwards, and freezing flags PyTorch ignores.
        self.modes: Optional[ModeWatch] = None
        if "module_modes" in self.wanted or "module_flags" in self.wanted:
            self.modes = ModeWatch(self.tracker)
            pipe.hooks.removers.append(self.modes.remove)
        self.autocast: Optional[AutocastProbe] = None
        if "autocast_dtypes" in self.wanted:
            self.autocast = AutocastProbe()
        self.roots: Optional[BackwardRoots] = None  # the loss, loose leaves (Tensor.backward)
        self._n_loss = 0
        if pipe.dist is not None and "replica_checksums" in self.wanted:  # replica_divergence
            pipe.dist.replicas = ReplicaCheck(pipe.structure.index, pipe.record)

    def install(self) -> None:
        """Hook the model's entry points and the scaler (once, at the first layout sync)."""
        pipe = self.pipe
        if self.probe is not None and not pipe.hooks.keep_all:  # each optimizer, once
            for track in pipe.structure.tracks:
                self.probe.install(track)
        if self.modes is not None and pipe.model is not None:  # at every layout sync
            idx = pipe.structure.index
            pipe.faults.guard(
                "mode watch",
                self.modes.collect,
                pipe.model,
                lambda p: p.requires_grad and idx.lookup(p) is not None,
            )
        _watch_zero_grad(self)  # at every sync: an optimizer added during the run too
        if self._newer_installed or pipe.model is None:
            return
        self._newer_installed = True
        index = pipe.structure.index
        self.roots = BackwardRoots.wanted_by(self.wanted, pipe, self.scout)
        modes = "module_modes" in self.wanted
        wanted = "forward_runs" in self.wanted or self.scout.scanning or modes
        nan_probe = "nan_probe" in self.wanted
        # Under torch.compile no hook may come or go (each is a dynamo guard: a recompile),
        # and the scout's come and go by design: a compiled model gets none of them.
        if pipe.hooks.keep_all:
            self._say_compiled(wanted, nan_probe)
        elif wanted or nan_probe:
            self.scout.install(pipe.model, lambda p: index.lookup(p) is not None)
            pipe.hooks.removers.append(self.scout.remove_all)
            if modes and self.modes is not None:
                self.scout.on_outer = self.modes.seen
        if self.autocast is not None and not pipe.hooks.keep_all:
            self.autocast.install(pipe.model)
            pipe.hooks.removers.append(self.autocast.remove)
            if nan_probe and self.wanted["nan_probe"] > 0:
                # On for the first steps (a NaN from the first batches is traced at once,
                # before the update spreads it into the weights); a flag per module call is
                # the costliest hook, so at most FIRST_TRACE_STEPS steps.
                limit = self.config.trim_hooks_after
                self.scout.arm(10**9 if limit is None else min(limit, FIRST_TRACE_STEPS))
        if pipe.scaler.scaler is not None and "unscale_watch" in self.wanted:
            guard = pipe.faults.guard
            self._unscale = UnscaleWatch(
                pipe.scaler.scaler, lambda opt: guard("unscale watch", self.unscaling, opt)
            )
            pipe.hooks.removers.append(self._unscale.remove)

    def _say_compiled(self, wanted: bool, nonfinite: bool) -> None:
        """Under torch.compile the scout stays off: say which checks that leaves blind."""
        judges = self.pipe.judges
        blind = [
            *judges.needing("forward_runs"),
            *judges.needing("module_modes"),
            *(judges.needing("module_scan") if self.scout.scanning else []),
            *(
                f"{c}'s forward origin (details.phase/origin_module)"
                for c in (judges.needing("nan_probe") if nonfinite else [])
            ),
        ]
        if not (wanted or nonfinite) or not blind:
            return
        fact = Fact(
            UNOBSERVABLE,
            step=0,
            key="compiled_forward",
            message="The model runs under torch.compile, where gradwatch adds no forward "
            f"hooks of its own (each would be a recompile): {', '.join(blind)} "
            "cannot be checked. Ghost parameters, gradient statistics and the other "
            "checks run as usual.",
            hint="Run a few steps without torch.compile (or `gradwatch check` on the eager "
            "model) to cover these checks.",
            details={"reason": "compiled_forward", "checks": blind},
        )
        self.pipe.record(fact)

    def note_backward_call(self) -> None:
        """An integration saw ``backward()`` requested (Lightning's ``on_before_backward``)."""
        self.backward_calls = (self.backward_calls or 0) + 1

    def unscaling(self, optimizer: object) -> None:
        """The scaler is about to unscale ``optimizer``'s gradients: which changed while scaled?

        Under DDP the reducer writes the averaged gradients after their accumulation: the
        version counter cannot tell that from an edit, so nothing is judged there.
        """
        if self.pipe.dist is not None:
            return
        structure = self.pipe.structure
        opts = structure.optimizers
        k = next(
            (
                j
                for j, o in enumerate(opts)
                if o is optimizer or o is getattr(optimizer, "optimizer", None)
            ),
            None,
        )
        track = structure.track_of(k) if k is not None else None
        if track is None:
            return
        t, start = self.tracker, track.start
        edited = []
        for i, p in zip(track.ids, track.params):
            g = p.grad
            if g is None or t.last_seq[i] <= start or g._base is not None:
                continue
            if t.acc_ref[i]() is not g or g._version != t.acc_ver[i]:
                edited.append(i)
        self.scaled_edits[k] = edited

    def window(
        self, track: Track, g: Gathered, trace: Optional[dict], skipped: int
    ) -> WindowEvidence:
        """What this step's window showed besides its gradients; (dis)arms the NaN probe."""
        start, scout, tracker = track.start, self.scout, self.tracker
        model_ran = None
        if scout.ran_grad > start:
            model_ran = "grad"
        elif scout.ran_nograd > start:
            model_ran = "no_grad"
        called = None
        if self.backward_calls is not None:
            called = self.backward_calls > self._calls_at_start.get(track.index, 0)
        last_seq, acc_ref = tracker.last_seq, tracker.acc_ref
        # A step the GradScaler skipped had inf/NaN gradients too: trace those as well.
        nonfinite = any(g.nonfinite) or skipped > 0
        nan_trace = None
        if scout.armed:
            scout.armed_steps += 1
            if nonfinite:
                nan_trace = trace
            if (nonfinite and trace is not None) or scout.armed_steps >= scout.arm_limit:
                scout.disarm()
        elif nonfinite and "nan_probe" in self.wanted:
            scout.arm(self.wanted["nan_probe"])
        return WindowEvidence(
            model_ran=model_ran,
            backward_called=called,
            acc_state=lambda i: (last_seq[i], acc_ref[i]()),
            # Gradients written by hand (p.grad = torch.autograd.grad(...)) fire no
            # accumulation hook: a new .grad tensor since the last step (core/steps.py)
            # tells them apart from a cut-off loss.
            grads_assigned=g.assigned,
            scaled_edits=self.scaled_edits.pop(track.index, None),
            unregistered=scout.take_unregistered(),
            nan_trace=nan_trace,
            modes=self.modes.take(start) if self.modes is not None else None,
            freeze_flags=self.modes.flags if self.modes is not None else [],
            autocast=self._autocast_dtypes(),
            scheduler_steps=self._scheduler_steps(track),
            repeated_backward=self.repeated,
            loose=self.roots.take_loose(bool(tracker.fwd_first)) if self.roots else [],
            loss_finite=self.roots.verdict(skipped) if self.roots is not None else None,
            # A step the GradScaler skipped still steps the schedule; accelerate steps it once
            # per process.
            scheduler_allowed=(1 + skipped) * (self.pipe.dist.world_size if self.pipe.dist else 1),
            edited_after_step=(
                self.after_step.take(track.index) if self.after_step is not None else None
            ),
            discarded_passes=(  # a step the GradScaler skipped drops its gradient rightly
                discarded_passes(
                    tracker, track, self.pipe.structure.tracks, exact=self.pipe.dist is None
                )
                if "discarded_passes" in self.wanted and not skipped
                else 0
            ),
        )

    def probe_flags(self, track: Track) -> list[Any]:
        """The loss flags and the probe's device flags for this step's transfer (see
        :meth:`took_probe`)."""
        loss = self.roots.loss_flags() if self.roots is not None else []
        self._n_loss = len(loss)
        return [*loss, *(self.probe.flags(track.index) if self.probe is not None else [])]

    def took_probe(self, g: Gathered, flags: list[Any]) -> None:
        """Take the probe's value and the losses' verdict off the end of the extra values."""
        self.repeated = 0
        if len(flags) > self._n_loss and g.extra:
            self.repeated = int(g.extra.pop())
        if self._n_loss and g.extra and self.roots is not None:
            self.roots.read(g.extra.pop())

    def _scheduler_steps(self, track: Track) -> list[tuple[int, bool]]:
        if self.schedulers is None or track.index is None:
            return []
        opt = self.pipe.structure.optimizers[track.index]
        return self.schedulers.read(track.index, opt, track.steps == 0)

    def _autocast_dtypes(self) -> dict[str, Any]:
        """The output dtypes the autocast probe saw in this window (it stops after its steps)."""
        if self.autocast is None:
            return {}
        seen = self.autocast.take()
        self.autocast.after_step()
        return seen

    def window_closed(self, k: Optional[int]) -> None:
        """Optimizer ``k``'s window closed: backward requests are counted from here."""
        self._calls_at_start[k] = self.backward_calls or 0
        if self.roots is not None:
            self.roots.window_closed()

    def exit_trace(self, skipped: int) -> Optional[dict[str, Any]]:
        """At exit, for a last step the scaler skipped: read the probe now (no step waits)."""
        if not skipped or not self.scout.armed:
            return None
        flags = self.scout.pending_flags()
        return self.scout.interpret(to_host(flags) if flags else [])


def _watch_zero_grad(ev: ExtraEvidence) -> None:
    """``clip_after_step``'s evidence: each watched optimizer's ``zero_grad`` (once each)."""
    pipe = ev.pipe
    if "zero_grad_watch" not in ev.wanted or not pipe.structure.optimizers:
        return
    if ev.zero_watch is None:
        edits = ev.after_step = AfterStepEdits(
            ev.tracker, pipe.structure.track_of, lambda: pipe.backward_passes
        )
        guard = pipe.faults.guard
        ev.zero_watch = ZeroGradWatch([], lambda k: guard("zero_grad watch", edits.zeroing, k))
        pipe.hooks.removers.append(ev.zero_watch.remove)
    ev.zero_watch.cover(pipe.structure.optimizers)
