"""Tiny real LightningModules and a CPU Trainer factory shared by the Lightning tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradwatch

DIM = 8


def loader(n: int = 64, batch: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


class Regressor(pl.LightningModule):
    """An MLP; with ``ghost=True`` a layer built in ``__init__`` that ``forward`` never calls."""

    def __init__(self, ghost: bool = False, lr: float = 0.05) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
        self.ghost = nn.Linear(DIM, DIM) if ghost else None
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # self.ghost is forgotten here: that is the bug

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualRegressor(Regressor):
    """Manual optimization; ``zero_grad=False`` forgets ``opt.zero_grad()``."""

    def __init__(self, ghost: bool = False, zero_grad: bool = True) -> None:
        super().__init__(ghost=ghost)
        self.automatic_optimization = False
        self.do_zero_grad = zero_grad

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        if self.do_zero_grad:
            opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        opt.step()


class GAN(pl.LightningModule):
    """Two optimizers, manual optimization (Lightning 2 requires it for several optimizers)."""

    def __init__(self, ghost: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, DIM))
        self.discriminator = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
        self.g_ghost = nn.Linear(4, 4) if ghost else None  # never called

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 4)
        bce = nn.functional.binary_cross_entropy_with_logits
        ones = torch.ones(real.shape[0], 1)
        zeros = torch.zeros(real.shape[0], 1)

        opt_g.zero_grad()
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        self.manual_backward(g_loss)  # also fills the discriminator's .grad: D zeroes below
        opt_g.step()

        opt_d.zero_grad()
        fake = self.generator(z).detach()
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        g_params = list(self.generator.parameters())
        if self.g_ghost is not None:
            g_params += list(self.g_ghost.parameters())
        return [
            torch.optim.Adam(g_params, lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]


def trainer(root: Path, *callbacks: Any, **kw: Any) -> pl.Trainer:
    """A quiet CPU Trainer for tests: tiny, no checkpoints, no progress bar."""
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "limit_train_batches": 6,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "default_root_dir": str(root),
        "callbacks": list(callbacks),
    }
    args.update(kw)
    return pl.Trainer(**args)


def problems(report: gradwatch.Report) -> list[str]:
    """Findings at warning or error severity, as lines (empty on a clean run)."""
    return [f.line() for f in report.findings if f.severity in ("warning", "error")]


def ghost_params(report: gradwatch.Report) -> set[str]:
    return {p for f in report.by_check("ghost_param") for p in f.params}
