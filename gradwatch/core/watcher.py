"""``gradwatch.watch()``: hooks on an unchanged training loop, removed on exit.

:class:`Watcher` is the lifecycle facade: it wires the parts together on enter and takes
them apart on exit. Hooks (:mod:`~gradwatch.capture.grads.hooks`) record evidence
(:mod:`~gradwatch.capture.grads.evidence`); the step pipeline (:mod:`~gradwatch.core.steps`) turns it
into a view the checks judge; :func:`~gradwatch.core.build_report.build_report` makes the
report.

Example:
    >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
    ...     for x, y in loader:
    ...         optimizer.zero_grad()
    ...         loss_fn(model(x), y).backward()
    ...         optimizer.step()
    >>> watcher.report().raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

from torch import nn

from gradwatch.capture.facts import UNOBSERVABLE, Fact
from gradwatch.capture.grads.backward import BackwardEnds
from gradwatch.capture.grads.evidence import Tracker, task_id
from gradwatch.capture.grads.hooks import HookSet
from gradwatch.capture.grads.resets import sweep_resets
from gradwatch.capture.loop.scaler import ScalerWatch
from gradwatch.checks import ALL_CHECKS, Check
from gradwatch.checks.registry import SELF_CHECKS
from gradwatch.config import GradWatchConfig
from gradwatch.core.adapter_api import AdapterAPI
from gradwatch.core.build_report import build_report, finish
from gradwatch.core.entry import (
    ModelArg,
    OptimizerArg,
    OptimizerEntry,
    check_model,
    check_sinks,
    claim,
    note_unwatched_params,
    read_models,
    read_optimizers,
    release,
)
from gradwatch.core.faults import Faults
from gradwatch.core.findings import FindingLog, Judges, call_site
from gradwatch.core.layers import LayerRecorder
from gradwatch.core.steps import StepPipeline
from gradwatch.core.structure import Structure
from gradwatch.distributed.layout import hook_backward, report_layout
from gradwatch.distributed.sync import DistSync
from gradwatch.errors import GradWatchError
from gradwatch.model.locations import Locations
from gradwatch.persist import ReportRefresher, holding_interrupts, write_outputs
from gradwatch.probes.watched import AutoProbes
from gradwatch.report import Report
from gradwatch.report_io import write_watched_report

__all__ = ["Watcher", "watch"]

ConfigArg = Union[GradWatchConfig, dict[str, Any], str, Path, None]


def watch(
    model: ModelArg,
    optimizer: OptimizerArg = None,
    *,
    config: ConfigArg = None,
    scaler: Any = None,
    sinks: Sequence[Any] = (),
) -> Watcher:
    """Watch ``model`` (and its optimizers) while an ordinary training loop runs.

    Args:
        model: the module being trained (DDP/DataParallel/compiled wrappers are unwrapped),
            or named models ``{"G": netG, "D": netD}``: parameters are then named with their
            model's prefix, ``G:main.0.weight``.
        optimizer: one optimizer, several (a sequence), named ones (``{"G": opt_g, ...}``,
            keyed by the model each trains when the models are named), or ``None`` (then
            each backward pass is a step and the optimizer checks are off; an optimizer
            built later is attached with :meth:`Watcher.add_optimizer`).
        config: a :class:`GradWatchConfig`, a dict, or a path to a YAML/TOML/JSON file.
        scaler: a ``torch.amp.GradScaler`` whose skipped steps are expected (``info``).
        sinks: metric sinks (objects with ``log_metrics(step, metrics)``) fed on observed steps.

    Returns:
        A :class:`Watcher`; use it as a context manager.

    Example:
        >>> with gradwatch.watch(model, opt, config={"fail_on": "warning"}) as w:  # doctest: +SKIP
        ...     train()
        >>> print(w.report())  # doctest: +SKIP
    """
    return Watcher(model, optimizer, config=config, scaler=scaler, sinks=sinks)


class Watcher(AdapterAPI, OptimizerEntry):
    """Registers gradwatch's hooks on enter and removes every one of them on exit.

    Integrations use only its public methods (:class:`~gradwatch.core.adapter_api.AdapterAPI`:
    checkpoint state, faults, findings; :meth:`add_optimizer`).
    """

    def __init__(
        self,
        model: ModelArg,
        optimizer: OptimizerArg = None,
        *,
        config: ConfigArg = None,
        scaler: Any = None,
        sinks: Sequence[Any] = (),
    ) -> None:
        models = read_models(model)
        optimizers, names = read_optimizers(optimizer, models)
        self.config = GradWatchConfig.coerce(config)
        self._model: Optional[nn.Module] = models.root
        self._names, self._fresh = models.names, set()  # model names; see add_optimizer
        self._log = FindingLog(self.config)
        self._faults = Faults(self.config)
        self._tracker = Tracker()
        on_error = self._faults.callback()
        self._ends = BackwardEnds(self._tracker, self._end_callback(), on_error)
        self._log.locations = Locations(  # source lines of findings
            self._model, self._tracker.called_at, self._tracker.want_call, call_site, on_error
        )
        self._hooks = HookSet(self._tracker, self._arrival_callback(), on_error)
        # Under torch.compile, hooks stay put: adding/removing one costs a recompile.
        self._hooks.keep_all = models.compiled
        self._wrappers = [weakref.ref(m) for m in models.wrappers]
        checks: list[Check] = [
            cls(self.config.check(cls.id), self.config)
            for cls in ALL_CHECKS
            if self.config.check(cls.id).enabled
        ] + [cls(cls.Config(), self.config) for cls in SELF_CHECKS]
        judges = Judges(checks, self._log, self._faults.guard)
        self._faults.connect(judges.fact)  # a fault is a fact the internal_error check judges
        dist = DistSync.detect()
        if dist is not None and dist.rank != 0:
            self._log.emit_warnings = False
        self._rank0 = dist is None or dist.rank == 0
        self._hooks.arrival.light = models.light_hooks(dist)
        self._ends.flush = self._hooks.arrival.deferred.flush
        self._pipe = StepPipeline(
            self._model,
            self.config,
            Structure(optimizers, self._tracker, ddp_find_unused=models.find_unused, names=names),
            self._hooks,
            judges,
            self._log,
            self._faults,
            ScalerWatch(scaler),
            LayerRecorder(self.config.history, check_sinks(sinks)),
            dist,
        )
        self._pipe.sharded = models.engine
        self._auto = AutoProbes(self._pipe, self._faults, models.wrappers)
        self._flat = [weakref.ref(p) for p in models.flat] if self._pipe.sharded else []
        self._refresher = ReportRefresher.claimed(
            self.config.report_path, self.config.report_every_n_steps, self._write_current
        )
        self._depth = 0  # nested ``with watcher:`` blocks; the outermost exit closes
        self._attached = False
        self._closed = False
        self._final: Optional[Report] = None

    # -- counters and state other parts read -----------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer steps seen (backward passes without an optimizer)."""
        return self._pipe.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._pipe.steps = value

    @property
    def backward_passes(self) -> int:
        """Completed backward passes seen."""
        return self._pipe.backward_passes

    @backward_passes.setter
    def backward_passes(self, value: int) -> None:
        self._pipe.backward_passes = value

    @property
    def metrics(self) -> dict[str, float]:
        """The latest per-layer gradient norms (observed steps), as sinks got them."""
        return self._pipe.recorder.metrics

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Watcher:
        self.attach()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self.close()

    def attach(self) -> Watcher:
        """Register every hook (``__enter__`` calls this)."""
        if self._closed:
            raise GradWatchError(
                "this watcher is closed: call gradwatch.watch() again to watch another run"
            )
        if self._attached:
            return self
        model = self._model
        assert model is not None
        check_model(model, self._names, self._pipe.structure.optimizers)
        claim(model, self)  # one watcher per model (its report file: claimed when made)
        self._attached = True
        try:
            # A parameter that refuses hooks is contained here as it is at a later sync.
            self._faults.guard("attach", self._pipe.sync, 0)
            self._restore_saved_state()  # load_state_dict() before attach
            _attach_sharded(self, model)
            self._faults.guard("attach", self._auto.install)
            for wrapper in (r() for r in self._wrappers):
                if wrapper is not None:
                    self._hooks.hook_compiled_wrapper(wrapper)
            for k in range(len(self._pipe.structure.optimizers)):
                self._hook_optimizer(k)
            self._refresher.install()
        except BaseException:
            self.close()
            raise
        return self

    @holding_interrupts
    def close(self) -> None:
        """Remove every hook, write the report where the config asks, drop the model."""
        if self._closed or not self._attached:
            self._closed = True
            self._refresher.release()  # never entered: it writes nothing, another may
            return
        self._closed = True
        faults = self._faults
        known = len(faults.where)
        try:
            # Never let bookkeeping at exit hide the user's own error (or skip the unhooking).
            faults.guard("exit", self._pipe.check_scaler)
            faults.guard("exit", note_unwatched_params, self._pipe)
            faults.guard("exit", finish, self._pipe, sorted(faults.where))
        finally:
            self._refresher.uninstall()
            self._hooks.remove_all()
            self._ends.remove()
            if self._model is not None:
                release(self._model, self)
            try:
                self._final = faults.guard("exit", self._build_report)
            finally:
                self._model = None
                self._pipe.release()
        self._pipe.recorder.close_sinks(faults.guard)
        known = self._refresh_final(known)
        faults.guard("report writing", write_outputs, self._final, self.config, self._rank0)
        self._refresh_final(known)
        self._refresher.release()  # its last write is done: another watcher may write it now

    def _refresh_final(self, known: int) -> int:
        """Rebuild the final report when faults were recorded since ``known`` were."""
        if len(self._faults.where) != known:  # faults at exit belong in the final report too
            final = self._faults.guard("exit", self._build_report)
            self._final = final if final is not None else self._final
        return len(self._faults.where)

    def _refresh(self) -> None:
        """Keep ``report_path`` current during the run (a preempted job still leaves one)."""
        self._refresher.maybe_refresh(self._pipe.steps, self._log.revision)

    def _write_current(self) -> None:
        path = self.config.report_path
        if path is not None:
            # Same place as the write at exit: an unwritable path is one fault, not two.
            self._faults.guard(
                "report writing", lambda: write_watched_report(self._build_report(), path)
            )

    # -- hook entry points (weak references: a hook must not keep the watcher alive) -------

    def _arrival_callback(self) -> Callable[[], None]:
        wself = weakref.ref(self)

        def on_arrival() -> None:
            me = wself()
            if me is not None:
                me._ends.arrived()
                if me._hooks.trimmed and me._pipe.structure.optimizers:
                    sweep_resets(me._tracker, me._pipe.structure.tracks)

        return on_arrival

    def _end_callback(self) -> Callable[[], None]:
        wself = weakref.ref(self)
        ends = _TaskEnds()

        def on_end() -> None:
            me = wself()
            if me is not None and not me._closed and ends.first(task_id()):
                with ends.lock:  # threads' backward passes end one at a time
                    me._faults.guard("backward end", _backward_end, me)

        return on_end

    # -- report ----------------------------------------------------------------------------

    def report(self) -> Report:
        """The :class:`~gradwatch.Report` so far (callable during or after the loop)."""
        if not self._attached:
            _never_entered(self)
        if self._closed and self._final is not None:
            return self._final
        return self._build_report()

    def _build_report(self) -> Report:
        return build_report(self._pipe)


def _backward_end(w: Watcher) -> None:
    """A backward pass of the user's ended (once per pass, see :class:`_TaskEnds`)."""
    w._pipe.backward_end()
    if not w._pipe.structure.optimizers:
        w._refresh()


class _TaskEnds:
    """The autograd graph tasks whose end was handled: one end per backward pass.

    Backward passes run by several threads at once interleave their gradients' arrivals, so
    one pass's end can be queued twice; its graph task id tells the second apart.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._seen: dict[int, None] = {}  # the latest ids, oldest first (ids only grow)

    def first(self, gid: int) -> bool:
        with self.lock:
            if gid >= 0 and gid in self._seen:
                return False
            self._seen[gid] = None
            if len(self._seen) > 256:
                del self._seen[next(iter(self._seen))]
            return True


def _never_entered(w: Watcher) -> None:
    """``w = watch(...)`` without ``with``: the report says nothing was watched (no pass)."""
    if not any(f.details.get("reason") == "never_entered" for f in w._log.findings()):
        message = "This watcher was never entered: no hook was installed, nothing was checked."
        hint = "Use `with gradwatch.watch(model, optimizer) as w:` around the training loop "
        hint += "(or call w.attach() before it and w.close() after it)."
        w._pipe.record(Fact(UNOBSERVABLE, 0, "never_entered", message, hint))


def _attach_sharded(w: Watcher, model: nn.Module) -> None:
    """Sharded engines: backward-pass evidence FSDP1 needs, and what the layout hides."""
    pipe = w._pipe
    on_arrival, on_error = w._arrival_callback(), w._faults.callback()
    hook_backward(pipe.sharded, model, w._flat, w._hooks.add, on_arrival, on_error)
    report_layout(pipe.sharded, pipe.record, pipe.structure.index, pipe.flat)
