"""The public face of a :class:`~gradwatch.Watcher` that integrations build on.

Framework adapters (the Lightning and Hugging Face callbacks, the pytest plugin, sinks)
checkpoint a watcher, report their own failures and read its findings through these
methods only, never through the watcher's private parts. They live in a mixin of their
own so the watcher's lifecycle code stays readable on one screen. The checkpoint state is
plain ``dict``/``list``/``str``/``int``/``float`` (:func:`pipeline_state`), so a checkpoint
holding it loads with ``torch.load(weights_only=True)``.

Example:
    >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
    ...     watcher.load_state_dict(checkpoint["gradwatch"])
    ...     train()
    ...     checkpoint["gradwatch"] = watcher.state_dict()
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from gradwatch.capture.grads.hooks import HookSet
from gradwatch.capture.loop.resume import compare, snapshot
from gradwatch.checks.sample_weight_split import SampleWeightDependsOnSplit
from gradwatch.config import GradWatchConfig
from gradwatch.core.faults import Faults
from gradwatch.core.findings import FindingLog
from gradwatch.core.steps import StepPipeline
from gradwatch.errors import GradWatchError
from gradwatch.report import Report
from gradwatch.results import Finding
from gradwatch.sources.calls import BackwardCallsSource
from gradwatch.sources.loss import LossSource

__all__ = [
    "STATE_VERSION",
    "AdapterAPI",
    "SavedState",
    "pipeline_state",
    "read_state",
    "restore_pipeline",
]


class _Parts(Protocol):
    """What :class:`AdapterAPI` needs of the class it is mixed into."""

    _log: FindingLog
    _model: Optional[Any]
    _pipe: StepPipeline
    _faults: Faults
    _attached: bool
    _closed: bool
    _saved_state: Optional[SavedState]
    _hooks: HookSet
    _resume: Optional[tuple[dict[str, Any], Optional[int]]]

    def report(self) -> Report: ...

    def _arm_resume(self) -> None: ...


class AdapterAPI:
    """Checkpoint state, fault reporting and findings: what an integration may use."""

    _saved_state: Optional[SavedState] = None  # loaded before attach, restored at attach
    _resume: Optional[tuple[dict[str, Any], Optional[int]]] = None  # to compare, and step

    def state_dict(self: _Parts, step: Optional[int] = None) -> dict[str, Any]:
        """The watcher's state for a checkpoint: findings so far, step counters, and what a
        faithful resume must restore (``resume_mismatch``: parameter checksums, optimizer
        step counts and moments, learning rates, LR schedulers' epochs).

        Only plain ``dict``/``list``/``str``/``int``/``float`` values, so the checkpoint
        loads with ``torch.load(..., weights_only=True)``. Callable during the run and
        after exit (then it holds the final report's findings, and nothing to compare a
        resume with). Reading the checksums costs one pass over the parameters and the
        optimizers' state, with one host transfer per device.

        Args:
            step: the training loop's own step counter (``global_step``), compared with the
                ``step`` given to :meth:`load_state_dict` when the run resumes.

        Returns:
            A dict for :meth:`load_state_dict` of the watcher of the resumed run.

        Example:
            >>> torch.save({"model": model.state_dict(), "gradwatch": watcher.state_dict()},
            ...            "last.ckpt")  # doctest: +SKIP
        """
        state = pipeline_state(self._pipe, self.report())
        pipe = self._pipe
        if self._attached and not self._closed and pipe.sources.wants("resume_state"):
            state["resume"] = snapshot(
                ((info.name, p) for info, p in pipe.structure.index.live()),
                pipe.structure.optimizers,
                pipe.steps,
                pipe.dist.world_size if pipe.dist is not None else 1,
                step,
                pipe.sharded is not None,
            )
        return state

    def load_state_dict(self: _Parts, state: dict[str, Any], step: Optional[int] = None) -> None:
        """Continue the findings and counters of a checkpointed run.

        A finding seen again after the resume merges into its restored one (``count``
        keeps growing) and is not warned about twice; step counters continue. Before
        :meth:`attach` the state is checked now and restored when the watcher attaches.

        The first optimizer step after it (before that step changes anything) compares
        the parameters, the optimizers' state, the learning rates and ``step`` with what
        :meth:`state_dict` recorded (``resume_mismatch``).

        Args:
            state: what :meth:`state_dict` returned in the checkpointed run.
            step: the training loop's step counter where it resumes (``global_step``).

        Raises:
            ValueError: ``state`` is not a gradwatch state of a known version.
            GradWatchError: the watcher is closed already.

        Example:
            >>> with gradwatch.watch(model, optimizer) as watcher:  # doctest: +SKIP
            ...     watcher.load_state_dict(torch.load("last.ckpt")["gradwatch"])
        """
        if self._closed:
            raise GradWatchError("this watcher is closed: load its state before or during the run")
        saved = read_state(state)
        resume = state.get("resume")
        self._resume = (dict(resume), step) if isinstance(resume, Mapping) else None
        if self._attached:
            restore_pipeline(self._pipe, saved)
            self._arm_resume()
        else:
            self._saved_state = saved

    def _restore_saved_state(self: _Parts) -> None:
        """At attach: restore what :meth:`load_state_dict` was given before."""
        saved, self._saved_state = self._saved_state, None
        if saved is not None:
            restore_pipeline(self._pipe, saved)
            self._arm_resume()

    def _arm_resume(self: _Parts) -> None:
        """One pre-step hook per optimizer: the first step after a resume compares what the
        checkpoint recorded with what was restored; after it they only return (torch cannot
        remove a hook while it runs them), and they go at exit with the others."""
        resume, self._resume = self._resume, None
        pipe = self._pipe
        if resume is None or not pipe.sources.wants("resume_state"):
            return
        wself = weakref.ref(self)
        done: list[bool] = []

        def first_step(*_: Any) -> None:
            if done:
                return
            done.append(True)
            me = wself()
            if me is not None and not me._closed:
                me._faults.guard("resume check", _compare_resume, me._pipe, *resume)

        for opt in pipe.structure.optimizers:
            self._hooks.add(opt.register_step_pre_hook(first_step))

    def note_backward_requested(self: _Parts) -> None:
        """An integration saw ``backward()`` requested for this step.

        Lightning's ``on_before_backward`` calls this: a batch whose ``training_step``
        returned ``None`` still steps the optimizer, and is then no ``loss_disconnected``.

        Example:
            >>> watcher.note_backward_requested()  # doctest: +SKIP
        """
        calls = self._pipe.sources.get(BackwardCallsSource)
        if calls is not None:
            calls.note()

    def note_loss(self: _Parts, loss: Any) -> None:
        """An integration saw this step's loss: a NaN/Inf loss behind finite gradients is a
        ``nonfinite_param`` finding.

        No host sync: a tensor's finiteness stays a device flag, read with the step's one
        transfer (a float, already on the host, is judged as it is). Lightning's
        ``on_before_backward`` and the HF callback's ``on_log`` call it; a plain loop needs
        nothing (``loss.backward()`` is seen). A loop whose backward gradwatch cannot see
        (``torch.autograd.backward([...])``) may call it with the loss.

        Args:
            loss: the loss tensor (any shape) or its float value.

        Example:
            >>> watcher.note_loss(loss)  # doctest: +SKIP
        """
        source = self._pipe.sources.get(LossSource)  # the Tensor.backward listener, if wanted
        if source is not None:
            source.note_loss(loss)

    def record_fault(self: _Parts, where: str, exc: BaseException) -> None:
        """Record a failure of an integration's own step as an ``internal_error`` finding.

        One finding per ``where``; training goes on unless the config says
        ``on_internal_error: raise`` (then ``exc`` is raised here).

        Args:
            where: the failing place, e.g. ``"checkpoint restore"``.
            exc: the exception it raised.

        Example:
            >>> try:  # doctest: +SKIP
            ...     upload(report)
            ... except Exception as exc:
            ...     watcher.record_fault("report upload", exc)
        """
        self._faults.error(where, exc)

    def findings(self: _Parts, check: Optional[str] = None) -> list[Finding]:
        """Copies of the findings so far (all, or those of ``check``), cheaper than a report.

        Args:
            check: a check's id (``GhostParam.id``); ``None`` for every finding.

        Example:
            >>> from gradwatch.checks.ghost import GhostParam  # doctest: +SKIP
            >>> [f.module for f in watcher.findings(GhostParam.id)]  # doctest: +SKIP
            ['head']
        """
        return [f for f in self._log.findings() if check is None or f.check == check]

    def probe(self: _Parts, batch: Any, loss_fn: Any) -> Report:
        """Run the probes (``gradient_mismatch``, ``sample_dependence``, ``does_not_learn``)
        on copies of the watched model, with its first optimizer's class and hyperparameters
        (:func:`gradwatch.probes.probe`); the run's weights, optimizer state and RNG state
        are untouched. Call it before the loop, inside or outside the ``with`` block.

        Example:
            >>> with gradwatch.watch(model, optimizer) as w:  # doctest: +SKIP
            ...     w.probe((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1])).print()
        """
        from gradwatch.probes import probe

        model = self._model
        if model is None:
            raise GradWatchError("Watcher.probe: the watcher is closed and holds no model")
        pipe = self._pipe
        opts = pipe.structure.optimizers
        return probe(model, batch, loss_fn, opts[0] if opts else None, config=_seen(pipe))


def _seen(pipe: StepPipeline) -> GradWatchConfig:
    """The run's config, with the accumulation the run showed (backward passes per step)
    where the user did not set ``accumulation_steps``: the split probe's severity reads it."""
    config = pipe.config
    check = SampleWeightDependsOnSplit.id
    cfg = config.check(check)
    if getattr(cfg, "accumulation_steps", None) is not None or pipe.steps <= 0:
        return config
    per_step = round(pipe.backward_passes / pipe.steps)
    if per_step <= 1:
        return config
    seen = cfg.model_copy(update={"accumulation_steps": per_step})
    return config.model_copy(update={"checks": config.checks.model_copy(update={check: seen})})


STATE_VERSION = 1


def _compare_resume(pipe: StepPipeline, saved: dict[str, Any], step: Optional[int]) -> None:
    """At the first resumed step: record a ``resumed`` fact per aspect not restored."""
    now = snapshot(
        ((info.name, p) for info, p in pipe.structure.index.live()),
        pipe.structure.optimizers,
        pipe.steps,
        pipe.dist.world_size if pipe.dist is not None else 1,
        step,
        pipe.sharded is not None,
    )
    for fact in compare(saved, now, pipe.steps):
        pipe.record(fact)


def pipeline_state(pipe: StepPipeline, report: Report) -> dict[str, Any]:
    """What a resumed run needs to continue ``pipe``'s findings and counters.

    ``report`` is the watcher's report so far (after exit: its final one); its findings are
    in the order of ``finding_keys``.
    """
    keyed = pipe.findings.keyed()
    return {
        "version": STATE_VERSION,
        "report": report.model_dump(mode="json"),
        "finding_keys": [[check, key] for (check, key), _ in keyed],
        "warned": [[check, name] for check, name in pipe.findings.warned_about()],
        "steps": pipe.steps,
        "backward_passes": pipe.backward_passes,
        "skipped_steps": pipe.scaler.skipped,
        "optimizer_steps": {str(t.index): t.steps for t in pipe.structure.tracks},
    }


@dataclass(frozen=True)
class SavedState:
    """A checked :func:`pipeline_state`, ready to go into a pipeline."""

    keyed: list[tuple[tuple[str, str], Finding]]
    warned: list[tuple[str, str]]
    steps: int
    backward_passes: int
    skipped_steps: int
    optimizer_steps: dict[str, int]


def read_state(state: Mapping[str, Any]) -> SavedState:
    """Check and convert :func:`pipeline_state` output (a checkpoint's plain data).

    Raises:
        ValueError: ``state`` is of an unknown version or its findings and keys disagree.
        pydantic.ValidationError: a saved finding is not a valid one.
    """
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown gradwatch checkpoint state version {state.get('version')!r}")
    findings = state["report"].get("findings", [])
    keys = state.get("finding_keys", [])
    if len(keys) != len(findings):
        raise ValueError("gradwatch checkpoint state: finding keys and findings do not match")
    return SavedState(
        keyed=[((str(c), str(k)), Finding.model_validate(f)) for (c, k), f in zip(keys, findings)],
        warned=[(str(check), str(name)) for check, name in state.get("warned", [])],
        steps=int(state.get("steps", 0)),
        backward_passes=int(state.get("backward_passes", 0)),
        skipped_steps=int(state.get("skipped_steps", 0)),
        optimizer_steps={str(k): int(v) for k, v in state.get("optimizer_steps", {}).items()},
    )


def restore_pipeline(pipe: StepPipeline, saved: SavedState) -> None:
    """Load a :func:`read_state` result into the pipeline of a freshly attached watcher.

    Findings go back into the finding log under their original keys, so the same problem
    seen again after the resume merges into one finding (``count`` keeps growing) and is
    not warned about twice. Counters add to what the new run has counted already.
    """
    pipe.findings.restore(saved.keyed, saved.warned)
    pipe.steps += saved.steps
    pipe.backward_passes += saved.backward_passes
    pipe.scaler.skipped += saved.skipped_steps
    for track in pipe.structure.tracks:
        track.steps += saved.optimizer_steps.get(str(track.index), 0)
        # the restored passes belong to finished steps
        track.backward_at_start += saved.backward_passes
