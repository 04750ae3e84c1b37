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


class GradWatchCallback(WatchAdapter, TrainerCallback):  # type: ignore[misc]
    """Run gradwatch's checks during ``Trainer.train()`` and report what they found.

    Args:
        config: a :class:`~gradwatch.GradWatchConfig`, a dict of its fields, or a path to a
            YAML/TOML/JSON file (a bad one raises :class:`~gradwatch.ConfigError` here).
        trainer: the ``Trainer`` this callback is added to (``trainer.add_callback(
            GradWatchCallback(trainer=trainer))``). Optional: with it, observed steps' metrics
            go through ``trainer.log`` and reach every ``report_to`` integration; without it
            they join the Trainer's own log records (``state.log_history`` and the callbacks
            after this one) at its ``logging_steps``.
        print_summary: print the one-screen summary on the main process when training ends.
        report_name: file name of the JSON report written to ``args.output_dir`` when
            training ends, on the main process; ``None`` writes none.
        log_metrics: send ``gradwatch/...`` metrics (per-layer gradient norms, total norm,
            findings count; a ghost layer's norm as 0) to the Trainer's log.

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

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Attach the watcher to the model, the Trainer's optimizer and its GradScaler."""
        self.close()  # a previous train() that raised never reached on_train_end
        self.report = None
        self.report_path = None
        optimizer = kwargs.get("optimizer")
        watcher = self._start(kwargs["model"], optimizer, _scaler_of(optimizer))
        step = int(getattr(state, "global_step", 0) or 0)
        path = _checkpoint_dir(args, step) / STATE_NAME
        if step and path.is_file():  # resumed: the Trainer restored its state of step N
            self._guarded(watcher, "checkpoint restore", _load_state, watcher, path, step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Save the watcher's state into the checkpoint folder the Trainer just wrote."""
        watcher = self.watcher
        if watcher is None or not bool(getattr(state, "is_world_process_zero", True)):
            return
        folder = _checkpoint_dir(args, int(state.global_step))
        if folder.is_dir():
            self._guarded(watcher, "checkpoint state", _save_state, watcher, folder, state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With a bound Trainer, log this optimizer step's metrics through ``trainer.log``."""
        if self.trainer is None or self.watcher is None:
            return
        values = self._metrics()
        if values:
            self._guarded(self.watcher, "metric logging", self.trainer.log, values)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        """Without a bound Trainer, join the latest metrics to the Trainer's own log record."""
        if self.trainer is not None or self.watcher is None or logs is None:
            return
        values = self._metrics()
        if not values:
            return
        logs.update(values)
        history = getattr(state, "log_history", None)
        # Trainer.log appended a copy of ``logs`` just before calling the callbacks.
        if history and history[-1].get("step") == state.global_step:
            history[-1].update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Remove the hooks, keep the report, write it and print its summary (main process)."""
        self.close(
            Path(args.output_dir) if args.output_dir else None,
            bool(getattr(state, "is_world_process_zero", True)),
        )

    def close(self, output_dir: Optional[Path] = None, main_process: bool = True) -> None:
        """Remove gradwatch's hooks now and keep the report (idempotent).

        ``on_train_end`` calls it; call it yourself after a ``train()`` that raised, which
        ``TrainerCallback`` gives no event for (the next ``train()`` also calls it).
        """
        if self._stop() is None or not main_process:
            return
        if output_dir is not None:
            self._write(output_dir)
        self._print()
