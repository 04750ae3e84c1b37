"""Which training batches Lightning logs, and at which logger step: its rule, from public state.

Lightning sends a batch's step metrics to the loggers right after ``on_train_batch_end``
(``_LoggerConnector.update_train_step_metrics``), at step ``n``, the number of batches that
stepped before this one, when

- the batch stepped: under automatic optimization a batch that only accumulates gradients
  logs nothing;
- and ``(n + 1) % log_every_n_steps == 0``, or the Trainer is stopping (``should_stop``);
  ``log_every_n_steps=0`` logs nothing;
- or always under ``fast_dev_run``.

``n`` is private state of the loop (``_batches_that_stepped``); here it is told from public
counters instead: under automatic optimization each batch that steps makes one optimizer
step, so ``n = global_step - 1`` once this batch has stepped; under manual optimization every
batch counts, so ``n`` is the number of batches completed before this one. The tests compare
the result with the rows Lightning itself writes to a ``CSVLogger`` in every mode.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["logging_step"]


def _accumulating(trainer: Any, batch_idx: int) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step at its end)."""
    every = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
    ready = batch_idx + 1  # batches of this epoch so far, this one included
    if ready % every == 0:
        return False
    loop = trainer.fit_loop.epoch_loop
    final = ready == trainer.num_training_batches or bool(loop.batch_progress.is_last_batch)
    return trainer.strategy.handles_gradient_accumulation or not final


def logging_step(trainer: Any, pl_module: Any, batch_idx: int) -> Optional[int]:
    """The logger step Lightning logs this training batch's metrics at; ``None`` if it logs none.

    Call it from ``on_train_batch_end``.

    Args:
        trainer: the running ``Trainer``.
        pl_module: its ``LightningModule``.
        batch_idx: the batch's index in its epoch (``on_train_batch_end``'s argument).

    Example:
        >>> logging_step(trainer, pl_module, batch_idx)  # doctest: +SKIP
        49
    """
    automatic = bool(getattr(pl_module, "automatic_optimization", True))
    if automatic:
        if _accumulating(trainer, batch_idx):
            return None
        step = int(trainer.global_step) - 1
    else:
        step = int(trainer.fit_loop.epoch_loop.batch_progress.total.completed)
    if trainer.fast_dev_run:
        return step
    every = int(trainer.log_every_n_steps)
    if every <= 0:
        return None
    if (step + 1) % every == 0 or trainer.should_stop:
        return step
    return None
