"""``GradWatchCallback``: gradwatch on a Hugging Face ``Trainer``, as a ``TrainerCallback``.

A thin adapter: when training begins it attaches :func:`gradwatch.watch` to the model and
the optimizer the Trainer made (an accelerate ``AcceleratedOptimizer``: the watcher hooks the
optimizer inside it, whose ``step`` runs once per real update, so gradient accumulation
counts optimizer steps, like ``state.global_step``). The ``GradScaler`` of fp16 training is
the one accelerate keeps on that optimizer. When training ends it closes the watcher (hooks
removed), writes the report to ``args.output_dir`` and prints the summary on the main
process. At each checkpoint it saves the watcher's state (:data:`STATE_NAME`) into the
Trainer's checkpoint folder; ``train(resume_from_checkpoint=...)`` of a checkpoint under
``args.output_dir`` loads it back, so findings continue and ``resume_mismatch`` compares
what was restored with what was saved.

Example:
    >>> from transformers import Trainer, TrainingArguments  # doctest: +SKIP
    >>> cb = GradWatchCallback(config={"fail_on": "warning"})
    >>> trainer = Trainer(model, TrainingArguments("out"), train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> cb.report.raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

from gradwatch.adapter import WatchAdapter
from gradwatch.config import GradWatchConfig

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "gradwatch.transformers needs Hugging Face transformers: pip install gradwatch[hf]"
    ) from None

__all__ = ["REPORT_NAME", "STATE_NAME", "GradWatchCallback"]

REPORT_NAME = "gradwatch-report.json"
STATE_NAME = "gradwatch_state.pt"  # in each checkpoint-N folder: the watcher's state


def _scaler_of(optimizer: Any) -> Any:
    """The ``GradScaler`` accelerate keeps on its optimizer wrapper (fp16), else ``None``."""
    seen = 0
    while optimizer is not None and seen < 16:
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            return scaler
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def _checkpoint_dir(args: Any, step: int) -> Path:
    """The folder the Trainer writes the checkpoint of ``step`` to (``checkpoint-N``)."""
    return Path(args.output_dir or ".") / f"checkpoint-{step}"


def _save_state(watcher: Any, folder: Path, state: Any) -> None:
    import torch

    tmp = folder / (STATE_NAME + ".tmp")
    torch.save(watcher.state_dict(step=int(state.global_step)), tmp)
    os.replace(tmp, folder / STATE_NAME)


def _load_state(watcher: Any, path: Path, step: int) -> None:
    import torch

    watcher.load_state_dict(torch.load(path, weights_only=True), step=step)


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose callback handler is calling this callback, if any.

    ``TrainerCallback`` events get the model, the optimizer and the data loaders but not the
    Trainer, and a callback given to ``Trainer(callbacks=[...])`` runs after the ``report_to``
    integrations: only ``Trainer.log`` reaches them. The Trainer is the ``self`` of the frame
    that dispatches ``on_train_begin`` (``Trainer._inner_training_loop``), a few frames up.
    """
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _finish_progress_bar(trainer: Any) -> None:
    """Close the Trainer's tqdm training bar now (``ProgressCallback`` closes it again later,
    a no-op), so that what is printed next starts on a line of its own."""
    from transformers.trainer_callback import ProgressCallback

    try:
        for cb in trainer.callback_handler.callbacks:
            bar = getattr(cb, "training_bar", None) if isinstance(cb, ProgressCallback) else None
            if bar is not None:
                bar.close()
    except Exception:  # a custom progress callback: its bar is its own business
        return


def _console_metric(key: str) -> bool:
    """Whether a logged key is fit for the console: all but gradwatch's per-layer norms."""
    return not key.startswith("gradwatch/grad_norm/")


class GradWatchCallback(WatchAdapter, TrainerCallback):  # type: ignore[misc]
    """Run gradwatch's checks during ``Trainer.train()`` and report what they found.

    Args:
        config: a :class:`~gradwatch.GradWatchConfig`, a dict of its fields, or a path to a
            YAML/TOML/JSON file (a bad one raises :class:`~gradwatch.ConfigError` here).
        trainer: the ``Trainer`` this callback is added to. Optional: without it the callback
            finds the Trainer that calls it when training begins (``Trainer(...,
            callbacks=[GradWatchCallback()])`` is enough).
        print_summary: print the one-screen summary on the main process when training ends.
        report_name: file name of the JSON report written to ``args.output_dir`` when
            training ends, on the main process; ``None`` writes none.
        log_metrics: send ``gradwatch/...`` metrics (per-layer gradient norms, total norm,
            findings count; a ghost layer's norm as 0) through ``Trainer.log`` at the
            Trainer's own logging steps (``logging_steps``/``logging_strategy``), so they
            reach every ``report_to`` integration and ``state.log_history``: the values of
            the latest step gradwatch observed since the previous log. The console
            (``ProgressCallback``/``PrinterCallback``) shows only the total norm and the
            findings count; callbacks listed after this one see the same. (Added later with
            ``trainer.add_callback``, the callback comes after the printers, which then show
            every metric.)
        fail_on_report: when the report of a finished ``train()`` failed, raise its
            :class:`~gradwatch.GradWatchError` from ``trainer.train()`` after the summary,
            so the job exits non-zero.

    Attributes:
        report: the :class:`~gradwatch.Report` of the last ``train()``; ``None`` before.
        watcher: the live :class:`~gradwatch.Watcher` during training.
        report_path: where the last report was written, if it was.

    Example:
        >>> cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
        >>> cb.config.every_n_steps
        1
    """

    log = logging.getLogger("gradwatch.transformers")

    def __init__(
        self,
        config: Union[str, dict[str, Any], GradWatchConfig, None] = None,
        *,
        trainer: Any = None,
        print_summary: bool = True,
        report_name: Optional[str] = REPORT_NAME,
        log_metrics: bool = True,
        fail_on_report: bool = False,
        probes: bool = False,
    ) -> None:
        # TrainerCallback defines no __init__: the adapter's is the whole of it.
        WatchAdapter.__init__(
            self,
            config,
            print_summary=print_summary,
            report_name=report_name,
            log_metrics=log_metrics,
        )
        self.trainer = trainer
        self.fail_on_report = fail_on_report
        self.probes = probes  # run gradwatch.probe once at train begin, on a copy
        self.probe_report: Optional[Any] = None
        self._found: Any = None  # the Trainer found calling on_train_begin
        self._emitting = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Attach the watcher to the model, the Trainer's optimizer and its GradScaler."""
        self.close()  # a previous train() that raised never reached on_train_end
        self.report = None
        self.report_path = None
        self._found = self.trainer or _calling_trainer()
        optimizer = kwargs.get("optimizer")
        watcher = self._start(kwargs["model"], optimizer, _scaler_of(optimizer))
        self.probe_report = None
        if self.probes:
            self._probe(kwargs["model"], kwargs.get("train_dataloader"), optimizer)
        step = int(getattr(state, "global_step", 0) or 0)
        path = _checkpoint_dir(args, step) / STATE_NAME
        if step and path.is_file():  # resumed: the Trainer restored its state of step N
            self._guarded(watcher, "checkpoint restore", _load_state, watcher, path, step)

    def _probe(self, model: Any, loader: Any, optimizer: Any) -> None:
        """The probes on a copy of ``model``, on a batch of the dataset's first samples."""
        from gradwatch.probes.fit_start import first_batch, probe_at_fit_start

        device = next((p.device for p in model.parameters()), None)
        batch = first_batch(loader, device)
        if batch is None:
            self.log.warning("gradwatch: probes skipped: no dataset to take a batch from")
            return
        step = lambda m, b: m(**b) if isinstance(b, dict) else m(b)  # noqa: E731
        self.probe_report = probe_at_fit_start(model, batch, step, optimizer, self.config)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Save the watcher's state into the checkpoint folder the Trainer just wrote."""
        watcher = self.watcher
        if watcher is None or not bool(getattr(state, "is_world_process_zero", True)):
            return
        folder = _checkpoint_dir(args, int(state.global_step))
        if folder.is_dir():
            self._guarded(watcher, "checkpoint state", _save_state, watcher, folder, state)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        """When the Trainer logs, log the latest metrics through ``Trainer.log`` too.

        A callback given to ``Trainer(callbacks=[...])`` runs after the ``report_to``
        integrations and before the console printers: a record of its own, sent from here
        through ``Trainer.log``, reaches the integrations and ``state.log_history`` with every
        metric, and loses its per-layer norms here before the printers show it. Without a
        Trainer to log through, the latest metrics join the Trainer's own record instead (for
        the callbacks after this one and ``state.log_history``).
        """
        if logs is None:
            return
        if self.watcher is not None and not self._emitting and "loss" in logs:
            self.watcher.note_loss(logs["loss"])  # nonfinite_param: a NaN loss, finite grads
        if self._emitting:  # our own record, on its way to the printers
            for key in [k for k in logs if not _console_metric(k)]:
                del logs[key]
            return
        watcher = self.watcher
        values = self._metrics() if watcher is not None else {}
        if not values:
            return
        if self._found is not None:
            self._emitting = True
            try:
                self._guarded(watcher, "metric logging", self._found.log, values)
            finally:
                self._emitting = False
            return
        logs.update({k: v for k, v in values.items() if _console_metric(k)})
        history = getattr(state, "log_history", None)
        # Trainer.log appended a copy of ``logs`` just before calling the callbacks.
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Remove the hooks, keep the report, write it and print its summary (main process).

        The summary comes after the Trainer's progress bar: this callback runs before
        ``ProgressCallback``, whose ``on_train_end`` would close the bar only after it.
        """
        if self._found is not None and bool(getattr(state, "is_world_process_zero", True)):
            _finish_progress_bar(self._found)
        self.close(
            Path(args.output_dir) if args.output_dir else None,
            bool(getattr(state, "is_world_process_zero", True)),
        )
        if self.fail_on_report and self.report is not None:
            self.report.raise_for_findings()

    def close(self, output_dir: Optional[Path] = None, main_process: bool = True) -> None:
        """Remove gradwatch's hooks now and keep the report (idempotent).

        ``on_train_end`` calls it; call it yourself after a ``train()`` that raised, which
        ``TrainerCallback`` gives no event for (the next ``train()`` also calls it).
        """
        self._found = None
        if self._stop() is None or not main_process:
            return
        if output_dir is not None:
            self._write(output_dir)
        self._print()
