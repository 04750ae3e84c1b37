"""``GradWatchCallback``: every gradwatch check on a Lightning ``Trainer``, as one callback.

The callback is a thin adapter: it attaches :func:`gradwatch.watch` to the LightningModule
and the Trainer's optimizers when fit starts, forwards the core's metrics to the Trainer's
loggers on Lightning's own logging steps (:mod:`._log_steps`), and closes the watcher (hooks
removed, report written) when fit ends or raises. The summary waits for the progress bar to
finish (a small callback appended after it); warnings during fit go through the bar's
``print`` (:mod:`._console`).
The core observes the raw torch optimizers' step hooks, so automatic optimization (where
Lightning runs the backward inside ``optimizer.step(closure)``), manual optimization,
gradient accumulation, clipping and mixed precision need no special casing here.

Example:
    >>> from pytorch_lightning import Trainer  # doctest: +SKIP
    >>> from gradwatch.lightning import GradWatchCallback
    >>> cb = GradWatchCallback(config={"fail_on": "warning"}, fail_on_report=True)
    >>> trainer = Trainer(callbacks=[cb], max_steps=100)  # doctest: +SKIP
    >>> trainer.fit(model)  # doctest: +SKIP
    >>> cb.report.raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from gradwatch.adapter import WatchAdapter
from gradwatch.config import GradWatchConfig
from gradwatch.errors import ConfigError
from gradwatch.lightning._artifacts import upload_report
from gradwatch.lightning._cli_errors import built_by_argument_parser, exit_as_cli
from gradwatch.lightning._console import BarWarnings
from gradwatch.lightning._log_steps import logging_step

if TYPE_CHECKING:
    import torch

__all__ = ["LIGHTNING_PACKAGES", "REPORT_NAME", "GradWatchCallback"]

log = logging.getLogger("gradwatch.lightning")

REPORT_NAME = "gradwatch-report.json"
INSTALL_HINT = "pip install gradwatch[lightning]"


def _training_step(module: Any, batch: Any) -> Any:
    """What the probes call as the loss: the module's own ``training_step`` (its loss)."""
    return module.training_step(batch, 0)


def _import_lightning() -> tuple[Any, ...]:
    """Every installed Lightning: ``lightning.pytorch`` and/or ``pytorch_lightning``.

    ``pip install lightning`` and ``pip install pytorch-lightning`` give two packages with two
    distinct ``Callback`` classes; a Trainer accepts only its own. Both are often installed
    side by side (``lightning`` pulls ``pytorch-lightning`` in through many plugins).
    """
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "gradwatch.lightning needs PyTorch Lightning (lightning or pytorch_lightning): "
            f"{INSTALL_HINT}"
        )
    return tuple(found)


LIGHTNING_MODULES: tuple[Any, ...] = _import_lightning()
LIGHTNING_PACKAGES: tuple[str, ...] = tuple(m.__name__ for m in LIGHTNING_MODULES)
pl = LIGHTNING_MODULES[0]
LIGHTNING_PACKAGE: str = pl.__name__
LIGHTNING_VERSION: str = getattr(pl, "__version__", "unknown")
# The callback subclasses the Callback of every installed Lightning, so that a Trainer (and a
# LightningCLI ``class_path``) of either package accepts it. The two bases define the same
# no-op hooks; Lightning calls hooks by name, so which one the MRO picks does not matter.
_CALLBACK_BASES: tuple[type, ...] = tuple(m.Callback for m in LIGHTNING_MODULES)


def _report_dir(trainer: Any) -> Path:
    """Where this fit's report goes: the first logger's versioned folder when it has one.

    CSV/TensorBoard loggers (of either Lightning) have a ``log_dir`` ending in ``version_N``;
    loggers that keep runs elsewhere (MLflow, W&B) get ``<default_root_dir>/gradwatch/<run
    id>`` and the report uploaded as an artifact as well, so that no run overwrites another.
    Read without ``Trainer.log_dir``'s broadcast: safe on one rank, e.g. on error.
    """
    root = Path(trainer.default_root_dir)
    for logger in getattr(trainer, "loggers", None) or []:
        log_dir = getattr(logger, "log_dir", None)
        if isinstance(log_dir, str) and log_dir:
            return Path(log_dir)
        version = getattr(logger, "version", None)
        if isinstance(version, (str, int)) and str(version):
            return root / "gradwatch" / str(version)
    return root


def _send(trainer: Any, values: dict[str, float], step: int) -> None:
    """Log ``values`` to every logger of the Trainer at ``step``, Lightning's own step.

    Not ``pl_module.log_dict``: Lightning re-sends a step metric's cached value at every
    later logging step of the epoch, which would repeat a stale observation as a new one.
    """
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


class _AfterProgressBar(*_CALLBACK_BASES):  # type: ignore[misc]
    """Appended last to the Trainer's callbacks, after the progress bar: the bar stops in its
    own ``teardown``/``on_exception``, and the summary printed here comes after its last line."""

    def __init__(self, finish: Any) -> None:
        self.finish = finish

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Fit is over and the bar is done: print the summary (and fail, if asked to)."""
        if stage == "fit":
            self.finish(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fit raised and the bar is stopped: print the summary if it has findings."""
        self.finish(trainer, crashed=True)


class GradWatchCallback(WatchAdapter, *_CALLBACK_BASES):  # type: ignore[misc]
    """Run gradwatch's checks during ``trainer.fit`` and report what they found.

    Args:
        config: a :class:`~gradwatch.GradWatchConfig`, a dict of its fields, or a path to a
            YAML/TOML/JSON file (a bad one raises :class:`~gradwatch.ConfigError` here; under
            ``LightningCLI`` it is a one-line ``error:`` on stderr and exit status 2).
        print_summary: print the one-screen summary on rank 0 when fit ends, after the
            progress bar's last line.
        report_name: file name of the JSON report written when fit ends (or raises), on
            rank 0, to the run's own folder (the logger's ``version_N/``, or
            ``<default_root_dir>/gradwatch/<run id>/``) and logged as an artifact by loggers
            that store files (MLflow, W&B); ``None`` writes none.
        log_metrics: send ``gradwatch/...`` metrics (per-layer gradient norms, total norm,
            findings count; a ghost layer's norm as 0) to the Trainer's loggers on the steps
            where Lightning logs its own (``log_every_n_steps``), at Lightning's step: the
            values of the latest step gradwatch observed (every ``config.every_n_steps``
            optimizer steps) since the previous logging step, nothing when none was.
        fail_on_report: when the report of a finished fit failed (a finding at or above
            ``config.fail_on``), raise its :class:`~gradwatch.GradWatchError` (a
            :class:`~gradwatch.GhostLayerError` for ghosts) from ``trainer.fit`` once the
            summary is printed, so the job exits non-zero. Off by default: findings never
            stop a run unless asked (``config.fail_fast`` stops it at the step instead).

    Attributes:
        report: the :class:`~gradwatch.Report` of the last fit (also set when fit raised);
            ``None`` before.
        watcher: the live :class:`~gradwatch.Watcher` during fit.
        report_path: where the last report was written, if it was.

    Example:
        >>> cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
        >>> cb.config.every_n_steps
        1
    """

    log = log  # the adapter warns through this module's logger

    def __init__(
        self,
        config: Union[str, dict[str, Any], GradWatchConfig, None] = None,
        *,
        print_summary: bool = True,
        report_name: Optional[str] = REPORT_NAME,
        log_metrics: bool = True,
        fail_on_report: bool = False,
        probes: bool = False,
    ) -> None:
        # Lightning's Callback bases define no __init__: the adapter's is the whole of it.
        try:
            WatchAdapter.__init__(
                self,
                config,
                print_summary=print_summary,
                report_name=report_name,
                log_metrics=log_metrics,
            )
        except ConfigError as exc:
            if built_by_argument_parser():
                exit_as_cli(exc, config)
            raise
        self.fail_on_report = fail_on_report
        self.probes = probes  # run gradwatch.probe once, on the first batch, on a copy
        self.probe_report: Optional[Any] = None
        self._probe_due = False
        self._restored: Optional[dict[str, Any]] = None
        self._saved: Optional[dict[str, Any]] = None
        self._tail = _AfterProgressBar(self._finish)
        self._bar_warnings: Optional[BarWarnings] = None
        self._print_due = False
        self._fail_due = False

    # -- attach / detach ----------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Forget the previous fit's report (optimizers do not exist yet: attach waits).

        Appends the small callback that prints the summary to the end of the Trainer's
        callbacks, after the progress bar (Lightning visits a callback appended during this
        loop in the same loop).
        """
        if stage != "fit":
            return
        self.report = None
        self.report_path = None
        self._print_due = self._fail_due = False
        if not any(cb is self._tail for cb in trainer.callbacks):
            trainer.callbacks.append(self._tail)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach the watcher to the module, the Trainer's optimizers and its GradScaler."""
        self._close(trainer)  # a previous fit that never reached its end
        bar = getattr(trainer, "progress_bar_callback", None)
        if bar is not None and bool(getattr(trainer, "is_global_zero", True)):
            self._bar_warnings = BarWarnings(bar)
            self._bar_warnings.install()
        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        watcher = self._start(pl_module, list(trainer.optimizers), scaler)
        self._probe_due, self.probe_report = self.probes, None
        if self._restored is not None:
            state, self._restored = self._restored, None
            try:
                watcher.load_state_dict(state)
            except Exception as exc:  # a stale or foreign checkpoint must not stop training
                watcher.record_fault("checkpoint restore", exc)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Remove the hooks, keep the report and write it on rank 0 (printed after the bar)."""
        self._close(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fit raised (``fail_fast`` included): remove the hooks, keep and write the report.

        The summary is printed only when there are findings: they may explain the crash
        (a ghost layer under DDP dies at the next forward), a clean table would be noise.
        """
        self._close(trainer, crashed=True)
        if not any(cb is self._tail for cb in trainer.callbacks):
            self._finish(trainer, crashed=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Last resort: never leave hooks behind, whatever path fit took."""
        if stage != "fit":
            return
        self._close(trainer)
        if not any(cb is self._tail for cb in trainer.callbacks):
            self._finish(trainer)

    def _close(self, trainer: Any, *, crashed: bool = False) -> None:
        watcher = self._stop()
        if watcher is None:
            return
        self._saved = self._guarded(watcher, "checkpoint state", watcher.state_dict)
        self._fail_due = not crashed
        if not bool(getattr(trainer, "is_global_zero", True)):
            return
        self._write(_report_dir(trainer))
        if self.report_path is not None:
            try:
                upload_report(list(getattr(trainer, "loggers", None) or []), self.report_path)
            except Exception as exc:  # a tracking server down must not fail a finished fit
                log.warning("gradwatch could not log its report as an artifact: %r", exc)
        self._print_due = not (crashed and self.report is not None and not self.report.findings)

    def _finish(self, trainer: Any, *, crashed: bool = False) -> None:
        """After the progress bar: print the summary; with ``fail_on_report``, fail the fit."""
        self._close(trainer, crashed=crashed)  # on_fit_end did, unless a path skipped it
        hook, self._bar_warnings = self._bar_warnings, None
        if hook is not None:
            hook.remove()
        if self._print_due:
            self._print_due = False
            self._print()
        fail, self._fail_due = self._fail_due and not crashed, False
        if fail and self.fail_on_report and self.report is not None:
            self.report.raise_for_findings()

    # -- per-step hooks: the core observes autograd and the optimizers itself ------------

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Tell the core a backward was requested (a batch skipped by returning ``None``
        from ``training_step`` still steps the optimizer, and is no ``loss_disconnected``),
        and the loss (``nonfinite_param``: a NaN loss behind finite gradients)."""
        if self.watcher is not None:
            self.watcher.note_backward_requested()
            self.watcher.note_loss(loss)  # a NaN loss behind finite gradients

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Nothing to do: the parameters' own hooks saw the gradients arrive."""

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        """Nothing to do: gradients are unscaled here and the core reads them at the step."""

    def on_before_zero_grad(
        self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        """Nothing to do: the core tells a reset gradient by its identity and version."""

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """With ``probes=True``, once: the probes on a copy, with the first batch and the
        Trainer's first optimizer (``probe_report``; failing findings are logged)."""
        if not self._probe_due:
            return
        self._probe_due = False
        from gradwatch.probes.fit_start import probe_at_fit_start

        opt = trainer.optimizers[0] if trainer.optimizers else None
        self.probe_report = probe_at_fit_start(pl_module, batch, _training_step, opt, self.config)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Where Lightning logs this batch, send the latest observed metrics at its step."""
        watcher = self.watcher
        if watcher is None or not trainer.loggers:
            return
        step = self._guarded(watcher, "metric logging", logging_step, trainer, pl_module, batch_idx)
        if step is None:
            return
        values = self._metrics()
        if values:
            self._guarded(watcher, "metric logging", _send, trainer, values, step)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Findings so far and step counters, so a resumed run keeps its statistics."""
        if self.watcher is not None:
            state = self._guarded(self.watcher, "checkpoint state", self.watcher.state_dict)
            return dict(state) if state else {}
        if self._saved is not None:
            return dict(self._saved)
        return dict(self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the state until ``on_fit_start`` attaches a watcher to restore it into."""
        self._restored = dict(state_dict) if state_dict else None
