"""``gradwatch.watch()``: hooks on an unchanged training loop, removed on exit.

Example:
    >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
    ...     for x, y in loader:
    ...         optimizer.zero_grad()
    ...         loss_fn(model(x), y).backward()
    ...         optimizer.step()
    >>> watcher.report().raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.checks import ALL_CHECKS, Check, StepView, StructureView
from gradwatch.checks.nonfinite import NonfiniteGrad
from gradwatch.config import GradWatchConfig
from gradwatch.core.compiled import is_compiled
from gradwatch.core.evidence import Tracker, make_forward_hook, make_param_hooks
from gradwatch.core.findings import FindingLog
from gradwatch.core.index import ParamIndex
from gradwatch.core.layers import LayerTrack
from gradwatch.core.optimizers import unwrap_optimizer
from gradwatch.core.pipeline import Gathered, Track, gather, layer_samples
from gradwatch.core.stats import flatten_cpu
from gradwatch.errors import ConfigError, GradWatchError, GradWatchWarning

__all__ = ["Watcher", "watch"]

log = logging.getLogger("gradwatch")

_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Watcher] = weakref.WeakKeyDictionary()

OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]
ConfigArg = Union[GradWatchConfig, dict[str, Any], str, Path, None]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel/``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _optimizers(optimizer: OptimizerArg) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        return [unwrap_optimizer(optimizer)]
    if isinstance(optimizer, Sequence) and not isinstance(optimizer, (str, bytes)):
        opts = list(optimizer)
    else:
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, a sequence of them or None, "
            f"not {type(optimizer).__name__}"
        )
    # Wrappers (accelerate, Lightning, ...) are followed to the optimizer that really steps.
    return [unwrap_optimizer(o, f"optimizer[{k}]") for k, o in enumerate(opts)]


def watch(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    config: ConfigArg = None,
    scaler: Any = None,
    sinks: Sequence[Any] = (),
) -> Watcher:
    """Watch ``model`` (and its optimizers) while an ordinary training loop runs.

    Args:
        model: the module being trained (DDP/DataParallel/compiled wrappers are unwrapped).
        optimizer: one optimizer, several, or ``None`` (then each backward pass is a step
            and the optimizer checks are off).
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


class Watcher:
    """Registers gradwatch's hooks on enter and removes every one of them on exit."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerArg = None,
        *,
        config: ConfigArg = None,
        scaler: Any = None,
        sinks: Sequence[Any] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"watch() needs a torch.nn.Module, got {type(model).__name__}")
        self.config = GradWatchConfig.coerce(config)
        self._model: Optional[nn.Module] = unwrap(model)
        # Under torch.compile, hooks stay put: adding/removing one costs a recompile.
        self._keep_hooks = is_compiled(model)
        self._optimizers: list[torch.optim.Optimizer] = _optimizers(optimizer)
        self._scaler = scaler
        self._sinks = list(sinks)
        self._index = ParamIndex()
        self._tracker = Tracker()
        self._log = FindingLog(self.config)
        self._checks: list[Check] = [
            cls(self.config.check(cls.id), self.config)
            for cls in ALL_CHECKS
            if self.config.check(cls.id).enabled
        ]
        self._handles: list[RemovableHandle] = []
        self._param_handles: dict[int, RemovableHandle] = {}
        self._pre_handles: dict[int, RemovableHandle] = {}
        self._pre_hooks: dict[int, Any] = {}
        self._hooked_modules: set[int] = set()
        self._hooked_at: dict[int, int] = {}
        self._tracks: list[Track] = []
        self._layer_tracks: dict[str, LayerTrack] = {}
        self._coverage: dict[str, int] = {}
        self._structure_key: Any = None
        self._last_hooked = 0
        self._fwd_handles: dict[str, RemovableHandle] = {}
        self._fwd_modules: dict[str, weakref.ref[nn.Module]] = {}
        self._fwd_wanted: set[str] = set()
        self._fwd_trimmed = False
        self._model_signature: tuple[int, ...] = ()
        self._lazy: list[weakref.ref[torch.Tensor]] = []
        self.backward_passes = 0
        self.steps = 0
        self._skipped = 0
        # The scale before any step: skips before the first successful step count too.
        scale0 = getattr(scaler, "_scale", None)
        self._last_scale: Optional[float] = (
            float(scale0)
            if isinstance(scale0, torch.Tensor)
            else getattr(scaler, "_init_scale", None)
        )
        self._internal: set[str] = set()
        self._attached = False
        self._closed = False
        self._final: Any = None
        self.metrics: dict[str, float] = {}
        from gradwatch.core.distributed import DistSync

        self._dist = DistSync.detect()
        if self._dist is not None and self._dist.rank != 0:
            self._log.emit_warnings = False

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Watcher:
        self.attach()
        return self

    def __exit__(self, *exc_info: object) -> None:
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
        other = _ACTIVE.get(model)
        if other is not None and other is not self:
            raise GradWatchError(
                f"{type(model).__name__} is already watched by another gradwatch watcher: "
                "exit it first (one watcher per model)"
            )
        for name, p in model.named_parameters():
            if p.device.type == "meta":
                raise ConfigError(
                    f"parameter '{name}' is on the meta device: materialize the model "
                    "(model.to_empty(device=...) and initialise it) before watching"
                )
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"{type(model).__name__} has no trainable parameters (none with requires_grad=True)"
            )
        _ACTIVE[model] = self
        self._attached = True
        try:
            self._sync_structure(step=0)
            for k, opt in enumerate(self._optimizers):
                self._handles.append(opt.register_step_pre_hook(self._make_opt_hook(k, pre=True)))
                self._handles.append(opt.register_step_post_hook(self._make_opt_hook(k, pre=False)))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every hook, write the report where the config asks, drop the model."""
        if self._closed or not self._attached:
            self._closed = True
            return
        self._closed = True
        faults = len(self._internal)
        try:
            # Never let bookkeeping at exit hide the user's own error (or skip the unhooking).
            self._guard("exit", self._check_scaler)
        finally:
            for h in [*self._handles, *self._fwd_handles.values()]:
                h.remove()
            self._fwd_handles.clear()
            for h in [*self._param_handles.values(), *self._pre_handles.values()]:
                h.remove()
            self._handles.clear()
            self._param_handles.clear()
            self._pre_handles.clear()
            self._pre_hooks.clear()
            if self._model is not None and _ACTIVE.get(self._model) is self:
                del _ACTIVE[self._model]
            try:
                self._final = self._guard("exit", self._build_report)
            finally:
                self._model = None
                self._optimizers = []
                for track in self._tracks:
                    track.params, track.snapshot, track.ref = [], None, None
                    track.snapshot_flat = None
        for sink in self._sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                self._guard("sink close", close)
        faults = self._refresh_final(faults)
        self._guard("report writing", self._write_outputs)
        self._refresh_final(faults)

    def _refresh_final(self, faults: int) -> int:
        """Rebuild the final report when faults were recorded since ``faults`` were known."""
        if len(self._internal) != faults:  # faults at exit belong in the final report too
            final = self._guard("exit", self._build_report)
            self._final = final if final is not None else self._final
        return len(self._internal)

    def _write_outputs(self) -> None:
        if self._final is None:
            return
        if self.config.report_path is not None:
            self._final.write(self.config.report_path)
        if self.config.console and (self._dist is None or self._dist.rank == 0):
            self._final.print()

    # -- structure -------------------------------------------------------------------------

    def _sync_structure(self, step: int) -> None:
        model = self._model
        if model is None:
            return
        index = self._index
        index.scan_model(model)
        self._model_signature = tuple(map(id, model.parameters()))
        optimizer_of: dict[int, list[int]] = {}
        for k, opt in enumerate(self._optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    i = index.lookup(p)
                    if i is None:
                        i = index.register_foreign(p, f"optimizer[{k}].group[{g}][{j}]")
                    optimizer_of.setdefault(i, []).append(k)
        self._tracker.grow(len(index.params))
        trainable, frozen = [], []
        self._lazy = []
        for info, p in index.live():
            if index.uninitialized(p):
                # No hook fits an uninitialised parameter: it is judged (it cannot have a
                # gradient) and hooked at the first backward end after it materialises.
                self._lazy.append(info.ref)
                if p.requires_grad:
                    trainable.append(info.idx)
                continue
            if p.requires_grad:
                trainable.append(info.idx)
                self._hook_param(info.idx, p)
            else:
                frozen.append(info.idx)
        self._hook_modules(model)
        key = (tuple(trainable), tuple(sorted(optimizer_of)), len(index.params))
        if self._tracks and key == self._structure_key:
            return
        self._structure_key = key
        self._rebuild_tracks(trainable, optimizer_of)
        outside = [i for i in optimizer_of if index.params[i].outside_model]
        self._coverage = {
            "trainable": len(trainable),
            "frozen": len(frozen),
            "trainable_numel": sum(index.params[i].numel for i in trainable),
            "frozen_numel": sum(index.params[i].numel for i in frozen),
            "in_optimizer": sum(1 for i in trainable if i in optimizer_of),
            "not_in_optimizer": sum(
                1 for i in trainable if i not in optimizer_of and not index.params[i].outside_model
            )
            if self._optimizers
            else 0,
            "frozen_in_optimizer": sum(1 for i in frozen if i in optimizer_of),
            "outside_model": len(outside),
            "optimizers": len(self._optimizers),
        }
        view = StructureView(
            index,
            trainable,
            frozen,
            set(optimizer_of),
            optimizer_of,
            bool(self._optimizers),
            extra={"step": step},
        )
        for check in self._checks:
            self._guard(f"{check.id} check", check.on_structure, view, self._log)
        if outside:
            self._log.emit(
                "param_outside_model",
                severity="info",
                step=step,
                message=f"{len(outside)} optimizer tensor(s) are not parameters of the watched "
                "model; watched under synthesized names.",
                hint="Watch the whole model (not a submodule) to get real parameter names.",
                params=index.names(outside),
                key="optimizer",
            )

    def _rebuild_tracks(self, trainable: list[int], optimizer_of: dict[int, list[int]]) -> None:
        index = self._index
        old = {t.index: t for t in self._tracks}
        tracks = []
        groups: list[tuple[Optional[int], list[int]]]
        if self._optimizers:
            groups = [
                (k, [i for i in trainable if k in optimizer_of.get(i, ())])
                for k in range(len(self._optimizers))
            ]
        else:
            groups = [(None, trainable)]
        for k, ids in groups:
            track = old.get(k) or Track(index=k, start=self._tracker.now())
            if k is not None:
                opt = self._optimizers[k]
                track.ref = weakref.ref(opt)
                track.signature = tuple(len(g["params"]) for g in opt.param_groups)
            params = [index.params[i].ref() for i in ids]
            live = [(i, p) for i, p in zip(ids, params) if p is not None]
            track.set_params(
                [i for i, _ in live], [p for _, p in live], [index.params[i].layer for i, _ in live]
            )
            track.snapshot = None
            tracks.append(track)
        self._tracks = tracks

    def _hook_param(self, i: int, p: torch.Tensor) -> None:
        if i in self._param_handles:
            return
        pre, post = make_param_hooks(
            self._tracker, i, weakref.ref(p), self._arrival_callback(), self._internal_error_cb()
        )
        self._param_handles[i] = p.register_post_accumulate_grad_hook(post)
        self._pre_hooks[i] = pre
        if not self._fwd_trimmed:  # every hook on until trim_hooks_after
            self._pre_handles[i] = p.register_hook(pre)
            self._tracker.has_pre[i] = True
        self._hooked_at[i] = self._last_hooked = self._tracker.now()

    def _install_pre_hooks(self) -> None:
        """Value checks for the parameters whose resets the version counter cannot tell."""
        tracker = self._tracker
        for i in tracker.want_pre:
            p = self._index.params[i].ref()
            if p is None or i in self._pre_handles or i not in self._pre_hooks:
                continue
            self._pre_handles[i] = p.register_hook(self._pre_hooks[i])
            tracker.has_pre[i] = True
        tracker.want_pre.clear()

    def _hook_modules(self, model: nn.Module) -> None:
        for name, mod in model.named_modules():
            if id(mod) in self._hooked_modules or not mod._parameters:
                continue
            self._hooked_modules.add(id(mod))
            self._fwd_modules[name or "(root)"] = weakref.ref(mod)
            if not self._fwd_trimmed:
                self._hook_forward(name or "(root)")

    def _hook_forward(self, layer: str) -> None:
        """Stamp when ``layer`` runs (and in which grad mode): a ghost's cause comes from it."""
        mod = self._fwd_modules.get(layer)
        module = mod() if mod is not None else None
        if module is None or layer in self._fwd_handles:
            return
        hook = make_forward_hook(self._tracker, layer, self._internal_error_cb())
        self._fwd_handles[layer] = module.register_forward_hook(hook)
        if not self._keep_hooks:  # compiled: the hook stamps nothing, causes read "unknown"
            self._tracker.fwd_since[layer] = self._tracker.now()

    def _trim_forward_hooks(self) -> None:
        """After ``trim_hooks_after`` steps keep hooks only where they found something to watch.

        A forward hook on every layer puts every module call on nn.Module's slow path; a
        ghost that appears later gets its hook back and its cause from its next missing step.
        """
        flagged = {f.module for f in self._log.findings() if f.check == "ghost_param"}
        for layer in [name for name in self._fwd_handles if name not in flagged]:
            self._fwd_handles.pop(layer).remove()
            self._tracker.fwd_since.pop(layer, None)
        # Value-check hooks stay where the version counter could not tell a reset apart.
        tracker = self._tracker
        for i in [i for i in self._pre_handles if i not in tracker.want_pre]:
            self._pre_handles.pop(i).remove()
            tracker.has_pre[i] = False
        tracker.want_pre.clear()
        self._fwd_trimmed = True

    # -- hooks -----------------------------------------------------------------------------

    def _arrival_callback(self) -> Any:
        wself = weakref.ref(self)

        def on_arrival() -> None:
            me = wself()
            if me is None or me._tracker.backward_queued:
                return
            me._tracker.backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(me._on_backward_end)

        return on_arrival

    def _internal_error_cb(self) -> Any:
        wself = weakref.ref(self)

        def on_error(where: str, exc: BaseException) -> None:
            me = wself()
            if me is not None:
                me._internal_error(where, exc)

        return on_error

    def _on_backward_end(self) -> None:
        self._tracker.backward_queued = False
        self.backward_passes += 1
        try:
            if self._lazy_materialised():
                self._sync_structure(step=self.steps)
            if not self._optimizers and self._tracks:
                self._decide(self._tracks[0])
        except (GradWatchError, GradWatchWarning):
            raise
        except Exception as exc:
            self._internal_error("backward end", exc)

    def _make_opt_hook(self, k: int, *, pre: bool) -> Any:
        wself = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            me = wself()
            if me is None or me._closed:
                return
            try:
                me._before_step(k) if pre else me._after_step(k)
            except (GradWatchError, GradWatchWarning):
                raise
            except Exception as exc:
                me._internal_error("optimizer pre-step hook" if pre else "optimizer step hook", exc)

        return hook

    def _track_of(self, k: Optional[int]) -> Optional[Track]:
        return next((t for t in self._tracks if t.index == k), None)

    def _observed(self, track: Track) -> bool:
        return track.steps % self.config.every_n_steps == 0

    def _before_step(self, k: int) -> None:
        track = self._track_of(k)
        if track is None or not self._observed(track) or not track.params:
            return
        if any(ParamIndex.uninitialized(p) for p in track.params):
            return  # no update ratio while a lazy parameter has no values yet
        with torch.no_grad():
            track.snapshot_flat = flatten_cpu(track.params, copy=True)  # the CPU path
            if track.snapshot_flat is None:
                track.snapshot = list(torch._foreach_mul(track.params, 1.0))

    def _after_step(self, k: int) -> None:
        opt = self._optimizers[k]
        track = self._track_of(k)
        if track is None:
            return
        signature = tuple(len(g["params"]) for g in opt.param_groups)
        if signature != track.signature:
            self._sync_structure(step=track.steps)
            track = self._track_of(k)
            assert track is not None
        self._decide(track)

    # -- the step decision -----------------------------------------------------------------

    def _lazy_materialised(self) -> bool:
        """Whether a lazy parameter got its values since the last structure sync."""
        live = (r() for r in self._lazy)
        return any(not ParamIndex.uninitialized(p) for p in live if p is not None)

    def _decide(self, track: Track) -> None:
        observed = self._observed(track)
        if (self._lazy and self._lazy_materialised()) or (
            observed and track.steps > 0 and self._structure_may_have_changed()
        ):
            self._sync_structure(step=track.steps)
            track = self._track_of(track.index) or track
        scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
        with torch.profiler.record_function("gradwatch::step"), torch.no_grad():
            g = gather(
                track,
                self._tracker,
                observed=observed,
                min_hooked_at=self._hooked_at,
                last_hooked=self._last_hooked,
                scaler_scale=scale if isinstance(scale, torch.Tensor) else None,
            )
        self._note_scale(g.scale, track.steps)
        view = self._view(track, g, observed)
        for check in self._checks:
            self._guard(f"{check.id} check", check.on_step, view, self._log)
        if observed:
            self._record_layers(view)
        self._tracker.snapshot(g.ids, g.grads)
        if self._tracker.want_pre and self._fwd_trimmed:
            self._install_pre_hooks()
        track.snapshot = track.snapshot_flat = None
        track.start = self._tracker.now()
        track.backward_at_start = self.backward_passes
        track.steps += 1
        self.steps += 1
        self._adjust_forward_hooks()
        self._log.raise_fail_fast()

    def _structure_may_have_changed(self) -> bool:
        """On observed steps: parameters added/replaced in the model, or one unfrozen."""
        model = self._model
        if model is None:
            return False
        signature = tuple(map(id, model.parameters()))
        if signature != self._model_signature:
            return True
        tracked = {i for t in self._tracks for i in t.ids}
        return any(
            p.requires_grad and info.idx not in tracked
            for info, p in self._index.live()
            if not info.outside_model
        )

    def _adjust_forward_hooks(self) -> None:
        for layer in self._fwd_wanted:
            self._hook_forward(layer)
        self._fwd_wanted.clear()
        limit = self.config.trim_hooks_after
        if (
            not self._fwd_trimmed
            and not self._keep_hooks
            and limit is not None
            and not self.config.fail_fast
            and self.steps >= limit
        ):
            self._trim_forward_hooks()

    def _view(self, track: Track, g: Gathered, observed: bool) -> StepView:
        index = self._index
        tracker = self._tracker
        start = track.start
        ranks = None
        numel = [index.params[i].numel for i in g.ids] if observed else []

        def cause(i: int) -> str:
            info = index.params[i]
            if info.outside_model:
                return "unknown"
            since = tracker.fwd_since
            if not any(since.get(o, start + 1) <= start for o in info.owners):
                # Its forward hook was off (trimmed after trim_hooks_after) during this window.
                self._fwd_wanted.add(info.layer)
                return "unknown"
            if any(tracker.fwd_grad.get(o, 0) > start for o in info.owners):
                return "disconnected"
            if any(tracker.fwd_nograd.get(o, 0) > start for o in info.owners):
                return "no_grad"
            return "not_called"

        ex = None
        if self._dist is not None:  # one all_gather: which rank missed what, and why
            ex = self._dist.exchange(
                g.ids, g.arrived, cause, tracker, track.params[0].device if track.params else None
            )
            ranks, g.arrived = ex.ranks_missing, ex.arrived
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
            world_size=self._dist.world_size if self._dist is not None else 1,
            scaler=self._scaler is not None,
            layers=layer_samples(g, numel, track) if observed else {},
        )

    def _record_layers(self, view: StepView) -> None:
        total = 0.0
        metrics: dict[str, float] = {}
        for layer, sample in view.layers.items():
            lt = self._layer_tracks.get(layer)
            if lt is None:
                lt = self._layer_tracks[layer] = LayerTrack(self.config.history)
            lt.update(view.step, sample)
            total += sample.norm**2
            metrics[f"grad_norm/{layer}"] = sample.norm
        # With several optimizers each step sees its own layers: name the total per optimizer
        # so that sinks do not get two different values for one series at one step.
        several = sum(1 for t in self._tracks if t.index is not None) > 1
        total_key = f"grad_norm_total/optimizer_{view.optimizer}" if several else "grad_norm_total"
        metrics[total_key] = total**0.5
        metrics["findings"] = float(len(self._log._findings))
        self.metrics = {**self.metrics, **metrics}
        for sink in self._sinks:
            self._guard("sink", sink.log_metrics, view.step, dict(metrics))

    def _note_scale(self, scale: Optional[float], step: int) -> None:
        if scale is None:
            return
        last, self._last_scale = self._last_scale, scale
        if last is None or scale >= last:
            return
        backoff = float(getattr(self._scaler, "_backoff_factor", 0.5)) or 0.5
        import math

        skipped = max(1, round(math.log(last / scale) / math.log(1.0 / backoff)))
        self._skipped += skipped
        for check in self._checks:
            if isinstance(check, NonfiniteGrad):
                check.on_skipped(skipped, self._skipped, step, self._log)

    def _check_scaler(self) -> None:
        scale = getattr(self._scaler, "_scale", None) if self._scaler is not None else None
        if isinstance(scale, torch.Tensor):
            self._note_scale(float(scale), self.steps)

    # -- faults ----------------------------------------------------------------------------

    def _guard(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (GradWatchError, GradWatchWarning):
            raise
        except Exception as exc:
            self._internal_error(where, exc)
            return None

    def _internal_error(self, where: str, exc: BaseException) -> None:
        if self.config.on_internal_error == "raise":
            raise exc
        if where in self._internal:
            return
        self._internal.add(where)
        summary = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
        log.warning("gradwatch internal error in %s: %r (training continues)", where, exc)
        self._log.emit(
            "internal_error",
            severity="warning",
            step=self.steps,
            message=f"gradwatch's {where} failed with {type(exc).__name__}: {exc}; "
            "training went on without it.",
            hint="This is a gradwatch bug or a faulty sink/check: please report it with the "
            "traceback in details.",
            key=where,
            details={"where": where, "error": repr(exc), "traceback": "".join(summary)},
        )

    # -- report ----------------------------------------------------------------------------

    def report(self) -> Any:
        """The :class:`~gradwatch.Report` so far (callable during or after the loop)."""
        if self._closed and self._final is not None:
            return self._final
        return self._build_report()

    def _build_report(self) -> Any:
        from gradwatch.core.build_report import build_report

        return build_report(self)
