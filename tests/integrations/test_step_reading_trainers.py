"""Reading arrivals at the step under the real Trainers: the same findings as every hook on.

Lightning runs zero_grad, forward and backward inside ``optimizer.step(closure)``, with
accumulation and clipping; the Hugging Face Trainer steps an accelerate-wrapped optimizer
with accumulation and clipping. Each trains a model of 60-110 tensors (enough for the step to
read arrivals at the default thresholds) twice: with the default configuration and with
``trim_hooks_after: null`` (every hook always on, the ground truth). Losses, weights and
findings (details included) must be the same, and the reading must have started.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _lightning_helpers import loader, trainer
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

STEPS = 30
Run = tuple[set[Any], list[torch.Tensor], int, int]  # findings, weights, read, steps


def _found(report: Any) -> set[tuple[str, str, tuple[str, ...], str]]:
    return {
        (f.check, f.severity, tuple(sorted(f.params)), json.dumps(f.details, sort_keys=True))
        for f in report.findings
    }


def _config(every_hook: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {"warn": False, "on_internal_error": "raise"}
    if every_hook:
        cfg["trim_hooks_after"] = None
    return cfg


class DeepModule(pl.LightningModule):
    """52 residual blocks (106 tensors); block 11 stops running at step 12 (a late ghost)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(52))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            if not (k == 11 and self.global_step >= 12):
                x = x + 0.1 * torch.tanh(block(x))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _lightning(root: Path, every_hook: bool) -> Run:
    from gradwatch.lightning import GradWatchCallback

    torch.manual_seed(0)
    model = DeepModule()
    cb = GradWatchCallback(
        _config(every_hook), print_summary=False, report_name=None, log_metrics=False
    )
    read = [0]

    class Probe(pl.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            if cb.watcher is not None:
                read[0] = max(read[0], len(cb.watcher._hooks.unhooked))

    run = trainer(
        root,
        cb,
        Probe(),
        max_steps=STEPS,
        limit_train_batches=2 * STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
    )
    run.fit(model, loader(n=16 * STEPS, batch=8))
    assert cb.report is not None
    weights = [p.detach().clone() for p in model.parameters()]
    return _found(cb.report), weights, read[0], cb.report.steps


def _compare(run: Callable[[Path, bool], Run], tmp_path: Path, min_read: int) -> set[Any]:
    """Both runs, compared; the findings (the same in both)."""
    want, want_w, never, steps = run(tmp_path / "a", True)
    have, have_w, read, got_steps = run(tmp_path / "b", False)
    assert never == 0 and read >= min_read, "the reading never started: the test proves nothing"
    assert got_steps == steps == STEPS
    assert all(torch.equal(a, b) for a, b in zip(want_w, have_w))
    assert have == want
    return have


def test_lightning_closure_accumulation_clipping(tmp_path: Path) -> None:
    found = _compare(_lightning, tmp_path, 64)
    assert {f[:2] for f in found} == {("ghost_param", "info")}  # the late ghost, found


def _hf(root: Path, every_hook: bool) -> Run:
    transformers = pytest.importorskip("transformers")
    from gradwatch.transformers import GradWatchCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=6, n_embd=32, n_head=4, vocab_size=99, n_positions=16
    )  # 76 tensors
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 99, (8,), generator=g) for _ in range(64)]
    data = [{"input_ids": ids, "labels": ids} for ids in rows]
    cb = GradWatchCallback(
        _config(every_hook), print_summary=False, report_name=None, log_metrics=False
    )
    read = [0]

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            if cb.watcher is not None:
                read[0] = max(read[0], len(cb.watcher._hooks.unhooked))

    args = transformers.TrainingArguments(
        output_dir=str(root),
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
    )
    transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[cb, Probe()]
    ).train()
    assert cb.report is not None
    weights = [p.detach().clone() for p in model.parameters()]
    return _found(cb.report), weights, read[0], cb.report.steps


def test_hf_trainer_accumulation_clipping(tmp_path: Path) -> None:
    _compare(_hf, tmp_path, 40)
