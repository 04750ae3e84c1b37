"""Probes at a Trainer's fit start (the Lightning and Hugging Face callbacks' ``probes=True``).

The callbacks hand over the module, one batch the Trainer already fetched (Lightning) or one
collated from the dataset's first samples (HF, :func:`first_batch`), and how a loss
is read from the module; the probes run on copies (:func:`gradwatch.probe`) and the result
is the callback's ``probe_report``. Framework-free: the adapters pass plain callables.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset

from gradwatch.config import GradWatchConfig
from gradwatch.probes import probe
from gradwatch.report import Report

__all__ = ["first_batch", "loss_of", "probe_at_fit_start"]

log = logging.getLogger("gradwatch.probes")


def loss_of(output: Any) -> Tensor:
    """The loss in what a step returned: a tensor, ``{"loss": ...}``, or an output with
    ``.loss`` (a Hugging Face ``ModelOutput``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return loss_of(output["loss"])
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    raise TypeError(f"no loss in the step's output ({type(output).__name__})")


def first_batch(loader: Any, device: Optional[torch.device]) -> Any:
    """One batch built from ``loader``'s first samples with its own ``collate_fn``, on
    ``device``: no iterator is started (the Trainer's, its sampler's RNG draw and
    accelerate's dataloader state stay as they are). ``None`` for a stream (an iterable
    dataset) or a loader without a dataset."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if dataset is None or collate is None or isinstance(dataset, IterableDataset):
        return None
    n = min(int(getattr(loader, "batch_size", None) or 8), len(dataset))
    batch = collate([dataset[i] for i in range(n)])
    if device is None:
        return batch
    if isinstance(batch, Mapping):
        return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(v.to(device) if isinstance(v, Tensor) else v for v in batch)
    return batch.to(device) if isinstance(batch, Tensor) else batch


def probe_at_fit_start(
    module: nn.Module,
    batch: Any,
    step: Callable[[nn.Module, Any], Any],
    optimizer: Any,
    config: GradWatchConfig,
) -> Report:
    """Run the probes with ``loss_fn = loss_of(step(copy, batch))``; log what failed.

    Warnings the step raises on a copy outside its Trainer (``self.log`` with no Trainer
    attached) are silenced: they are about the copy, not the user's run.
    """

    def loss_fn(model: nn.Module, b: Any) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return loss_of(step(model, b))

    report = probe(module, batch, loss_fn, optimizer, config=config)
    for finding in report.failing():
        log.warning("gradwatch probe: %s: %s", finding.check, finding.message)
    return report
