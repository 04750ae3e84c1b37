"""``GradWatchCallback``: gradwatch on a Hugging Face ``Trainer``, as a ``TrainerCallback``.

A thin adapter: when training begins it attaches :func:`gradwatch.watch` to the model and
the optimizer the Trainer made (an accelerate ``AcceleratedOptimizer``: the watcher hooks the
optimizer inside it, whose ``step`` runs once per real update, so gradient accumulation
counts optimizer steps, like ``state.global_step``). The ``GradScaler`` of fp16 training is
the one accelerate keeps on that optimizer. When training ends it closes the watcher (hooks
removed), writes the report to ``args.output_dir`` and prints the summary on the main
process.

Example:
    >>> from transformers import Trainer, TrainingArguments  # doctest: +SKIP
    >>> cb = GradWatchCallback(config={"fail_on": "warning"})
    >>> trainer = Trainer(model, TrainingArguments("out"), train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> cb.report.raise_for_findings()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Union

from gradwatch.config import GradWatchConfig
from gradwatch.core.watcher import Watcher, watch
from gradwatch.report import Report
from gradwatch.sinks.pending import PendingMetrics

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "gradwatch.transformers needs Hugging Face transformers: pip install gradwatch[hf]"
    ) from None

__all__ = ["REPORT_NAME", "GradWatchCallback"]

log = logging.getLogger("gradwatch.transformers")

REPORT_NAME = "gradwatch-report.json"


def _scaler_of(optimizer: Any) -> Any:
    """The ``GradScaler`` accelerate keeps on its optimizer wrapper (fp16), else ``None``."""
    seen = 0
    while optimizer is not None and seen < 16:
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            return scaler
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


class GradWatchCallback(TrainerCallback):  # type: ignore[misc]
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

    def __init__(
        self,
        config: Union[str, dict[str, Any], GradWatchConfig, None] = None,
        *,
        trainer: Any = None,
        print_summary: bool = True,
        report_name: Optional[str] = REPORT_NAME,
        log_metrics: bool = True,
    ) -> None:
        super().__init__()
        self.config = GradWatchConfig.coerce(config)
        self.trainer = trainer
        self.print_summary = print_summary
        self.report_name = report_name
        self.log_metrics = log_metrics
        self.report: Optional[Report] = None
        self.report_path: Optional[Path] = None
        self.watcher: Optional[Watcher] = None
        self._sink = PendingMetrics()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Attach the watcher to the model, the Trainer's optimizer and its GradScaler."""
        self.close()  # a previous train() that raised never reached on_train_end
        self.report = None
        self.report_path = None
        optimizer = kwargs.get("optimizer")
        self._sink = PendingMetrics()
        watcher = watch(
            kwargs["model"],
            optimizer,
            config=self.config,
            scaler=_scaler_of(optimizer),
            sinks=[self._sink] if self.log_metrics else (),
        )
        self.watcher = watcher.attach()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With a bound Trainer, log this optimizer step's metrics through ``trainer.log``."""
        if self.trainer is None or self.watcher is None:
            return
        values = self._take()
        if values:
            self._guarded("metric logging", self.trainer.log, values)

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
        values = self._take()
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
        watcher, self.watcher = self.watcher, None
        if watcher is None:
            return
        watcher.close()
        self.report = report = watcher.report()
        if not main_process:
            return
        if self.report_name and output_dir is not None:
            try:
                self.report_path = report.write(output_dir / self.report_name)
            except OSError as exc:  # a full disk must not turn a finished run into a crash
                log.warning("gradwatch could not write its report: %s", exc)
        if self.print_summary and not self.config.console:  # console=True: the core printed
            report.print()

    def _take(self) -> dict[str, float]:
        return {f"gradwatch/{k}": float(v) for k, v in self._sink.take(self.watcher).items()}

    def _guarded(self, where: str, fn: Any, *args: Any) -> Any:
        """Run an adapter step; a failure is an ``internal_error`` finding, never a crash."""
        try:
            return fn(*args)
        except Exception as exc:
            if self.watcher is not None:
                self.watcher._internal_error(where, exc)
            return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(fail_on={self.config.fail_on!r}, "
            f"every_n_steps={self.config.every_n_steps}, print_summary={self.print_summary})"
        )
