"""``GradWatchCallback``: every gradwatch check on a Lightning ``Trainer``, as one callback.

The callback is a thin adapter: it attaches :func:`gradwatch.watch` to the LightningModule
and the Trainer's optimizers when fit starts, forwards the core's metrics to the Trainer's
loggers, and closes the watcher (hooks removed, report written) when fit ends or raises.
The core observes the raw torch optimizers' step hooks, so automatic optimization (where
Lightning runs the backward inside ``optimizer.step(closure)``), manual optimization,
gradient accumulation, clipping and mixed precision need no special casing here.

Example:
    >>> from pytorch_lightning import Trainer  # doctest: +SKIP
    >>> from gradwatch.lightning import GradWatchCallback
    >>> cb = GradWatchCallback(config={"fail_on": "warning"})
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
from gradwatch.lightning._artifacts import upload_report

if TYPE_CHECKING:
    import torch

__all__ = ["LIGHTNING_PACKAGES", "REPORT_NAME", "GradWatchCallback"]

log = logging.getLogger("gradwatch.lightning")

REPORT_NAME = "gradwatch-report.json"
INSTALL_HINT = "pip install gradwatch[lightning]"


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


def _send(trainer: Any, values: dict[str, float]) -> None:
    """Log ``values`` to every logger of the Trainer, at the step Lightning itself logs at.

    Not ``pl_module.log_dict``: Lightning re-sends a step metric's cached value on every
    later step of the epoch, which would turn "every ``every_n_steps``" into every step.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    step = trainer.global_step if not isinstance(step, int) else step
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


class GradWatchCallback(WatchAdapter, *_CALLBACK_BASES):  # type: ignore[misc]
    """Run gradwatch's checks during ``trainer.fit`` and report what they found.

    Args:
        config: a :class:`~gradwatch.GradWatchConfig`, a dict of its fields, or a path to a
            YAML/TOML/JSON file (a bad one raises :class:`~gradwatch.ConfigError` here).
        print_summary: print the one-screen summary on rank 0 when fit ends.
        report_name: file name of the JSON report written when fit ends (or raises), on
            rank 0, to the run's own folder (the logger's ``version_N/``, or
            ``<default_root_dir>/gradwatch/<run id>/``) and logged as an artifact by loggers
            that store files (MLflow, W&B); ``None`` writes none.
        log_metrics: send ``gradwatch/...`` metrics (per-layer gradient norms, total norm,
            findings count; a ghost layer's norm as 0) to the Trainer's loggers on observed
            steps (every ``config.every_n_steps`` optimizer steps), at Lightning's own
            logging step.

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
    ) -> None:
        # Lightning's Callback bases define no __init__: the adapter's is the whole of it.
        WatchAdapter.__init__(
            self,
            config,
            print_summary=print_summary,
            report_name=report_name,
            log_metrics=log_metrics,
        )
        self._restored: Optional[dict[str, Any]] = None
        self._saved: Optional[dict[str, Any]] = None

    # -- attach / detach ----------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Forget the previous fit's report (optimizers do not exist yet: attach waits)."""
        if stage == "fit":
            self.report = None
            self.report_path = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Attach the watcher to the module, the Trainer's optimizers and its GradScaler."""
        self._close(trainer)  # a previous fit that never reached its end
        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        watcher = self._start(pl_module, list(trainer.optimizers), scaler)
        if self._restored is not None:
            state, self._restored = self._restored, None
            try:
                watcher.load_state_dict(state)
            except Exception as exc:  # a stale or foreign checkpoint must not stop training
                watcher.record_fault("checkpoint restore", exc)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Remove the hooks, keep the report, write it and print its summary on rank 0."""
        self._close(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fit raised (``fail_fast`` included): remove the hooks, keep and write the report.

        The summary is printed only when there are findings: they may explain the crash
        (a ghost layer under DDP dies at the next forward), a clean table would be noise.
        """
        self._close(trainer, crashed=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Last resort: never leave hooks behind, whatever path fit took."""
        if stage == "fit":
            self._close(trainer)

    def _close(self, trainer: Any, *, crashed: bool = False) -> None:
        watcher = self._stop()
        if watcher is None:
            return
        self._saved = self._guarded(watcher, "checkpoint state", watcher.state_dict)
        if not bool(getattr(trainer, "is_global_zero", True)):
            return
        self._write(_report_dir(trainer))
        if self.report_path is not None:
            try:
                upload_report(list(getattr(trainer, "loggers", None) or []), self.report_path)
            except Exception as exc:  # a tracking server down must not fail a finished fit
                log.warning("gradwatch could not log its report as an artifact: %r", exc)
        if crashed and self.report is not None and not self.report.findings:
            return
        self._print()

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

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Send the metrics of this batch's observed steps to the Trainer's loggers."""
        values = self._metrics()
        if not values or self.watcher is None or not trainer.loggers:
            return
        self._guarded(self.watcher, "metric logging", _send, trainer, values)

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
