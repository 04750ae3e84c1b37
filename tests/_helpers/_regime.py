"""Shared pieces of the training-regime checks' tests (issue 29): a plain loop, a tiny
Lightning Trainer run and a tiny Hugging Face Trainer run over any small module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import gradwatch

DIM = 8


def batches(n: int, seed: int = 0, dim: int = DIM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, dim, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


class EncoderDecoder(nn.Module):
    """An encoder and a decoder with dropout: the model whose decoder a helper puts in eval."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def plain_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int = 8,
    *,
    after_step: Optional[Callable[[int], None]] = None,
    config: Optional[dict[str, Any]] = None,
    train_first: bool = True,
) -> gradwatch.Report:
    """``model.train()`` once, then zero_grad / forward / backward / step under watch()."""
    if train_first:
        model.train()
    with gradwatch.watch(model, opt, config=config) as w:
        for step, (x, y) in enumerate(batches(steps)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if after_step is not None:
                after_step(step)
    return w.report()


def problems(report: gradwatch.Report) -> list[str]:
    return [f.line() for f in report.findings if f.severity in ("warning", "error")]


# -- Lightning ------------------------------------------------------------------------------


def lightning_fit(
    net: nn.Module,
    tmp_path: Path,
    *,
    on_step: Optional[Callable[[Any, int], None]] = None,
    validate: bool = False,
    config: Optional[dict[str, Any]] = None,
    lr: float = 0.01,
    **trainer_args: Any,
) -> gradwatch.Report:
    """Fit ``net`` (input DIM -> 1) as a LightningModule for 6 steps; ``on_step(module,
    batch_idx)`` runs inside ``training_step`` before the forward; ``validate`` adds a
    validation loop every 2 steps (Lightning switches eval/train around it)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gradwatch.lightning import GradWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if on_step is not None:
                on_step(self, batch_idx)
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=lr)

    class Validated(Module):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val", nn.functional.mse_loss(self(x), y))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, DIM, generator=g)
    data = TensorDataset(x, x[:, :1] * 0.5)
    cb = GradWatchCallback(config=config, print_summary=False)
    extra: dict[str, Any] = {}
    if validate:
        extra = {"val_check_interval": 2, "limit_val_batches": 1}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=[cb],
        **extra,
        **trainer_args,
    )
    loader = DataLoader(data, batch_size=8)
    module = Validated() if validate else Module()
    trainer.fit(module, loader, DataLoader(data, batch_size=8) if validate else None)
    assert cb.report is not None
    return cb.report


# -- Hugging Face ---------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, nan_rows: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        if nan_rows:  # a feature with missing values, every 8th row
            self.x[::8, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i, :1] * 0.5}


class LossOf(nn.Module):
    """Wraps ``net`` (DIM -> 1) into the HF Trainer's protocol: a dict with the loss."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def hf_train(
    model: nn.Module,
    tmp_path: Path,
    *,
    before_loss: Optional[Callable[[nn.Module], None]] = None,
    evaluate: bool = False,
    config: Optional[dict[str, Any]] = None,
    nan_rows: bool = False,
    **args: Any,
) -> gradwatch.Report:
    """Train ``model`` (an HF-protocol module) with ``transformers.Trainer`` for 6 steps;
    ``before_loss(model)`` runs in ``compute_loss`` before the forward; ``evaluate`` runs an
    evaluation every 2 steps (the Trainer switches eval/train around it)."""
    import transformers

    from gradwatch.transformers import GradWatchCallback

    class Trainer(transformers.Trainer):
        def compute_loss(self, model: nn.Module, inputs: Any, *a: Any, **kw: Any) -> Any:
            if before_loss is not None:
                before_loss(model)
            return super().compute_loss(model, inputs, *a, **kw)

    extra: dict[str, Any] = {}
    if evaluate:
        extra = {"eval_strategy": "steps", "eval_steps": 2}
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "max_steps": 6,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **extra,
        **args,
    }
    targs = transformers.TrainingArguments(**settings)
    cb = GradWatchCallback(config=config, print_summary=False)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=_Rows(nan_rows=nan_rows),
        eval_dataset=_Rows(16) if evaluate else None,
        callbacks=[cb],
    )
    trainer.train()
    assert cb.report is not None
    return cb.report
