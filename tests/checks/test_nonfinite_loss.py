"""``nonfinite_param`` for a NaN/Inf loss behind finite gradients (issue 29).

A loss term that carries no gradient (``.detach()``, a constant, a logged statistic) can be
NaN while every gradient stays finite: the weights train on, the loss curve is garbage.
Forms: a plain loop, gradient accumulation, a Lightning ``Trainer`` and an HF ``Trainer``.
Look-alikes: a finite loss; a NaN loss with NaN gradients (``nonfinite_grad``'s); a NaN
validation loss that is never backpropagated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _check_loops import run_steps
from _regime import DIM, hf_train
from torch import nn

import gradwatch
from gradwatch.checks.nonfinite_param import NonfiniteParam

ID = NonfiniteParam.id


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _loss_findings(report: gradwatch.Report) -> list[gradwatch.Finding]:
    return [f for f in report.by_check(ID) if f.details.get("cause") == "loss"]


def _aux(step: int, bad_step: int) -> torch.Tensor:
    """A logged statistic added to the loss through ``.detach()``: log of a negative number
    at ``bad_step``."""
    return torch.log(torch.tensor(-1.0 if step == bad_step else 2.0))


def test_nan_term_added_through_detach() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y) + 0.1 * _aux(k, 2).detach()
        loss.backward()
        opt.step()

    report = run_steps(model, opt, body, steps=5)
    (f,) = _loss_findings(report)
    assert f.severity == "error" and f.first_step == 2 and f.count == 1
    assert "loss was NaN/Inf" in f.message
    assert not report.by_check("nonfinite_grad")


def test_inf_micro_batch_under_gradient_accumulation() -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        for j, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
            scale = torch.tensor(float("inf")) if (k, j) == (1, 1) else torch.tensor(1.0)
            loss = nn.functional.mse_loss(model(xs), ys) / 2
            (loss + scale.log().detach()).backward()
        opt.step()

    (f,) = _loss_findings(run_steps(model, opt, body, steps=4))
    assert f.first_step == 1


class _NanLossModule:
    """A LightningModule whose ``training_step`` adds a detached NaN at batch 2."""

    @staticmethod
    def make() -> Any:
        import pytorch_lightning as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = _net()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                x, y = batch
                loss = nn.functional.mse_loss(self.net(x), y)
                return loss + _aux(batch_idx, 2).detach()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.01)

        return Module()


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_training_step_returning_a_nan_loss(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from gradwatch.lightning import GradWatchCallback

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    cb = GradWatchCallback(print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[cb],
    )
    trainer.fit(_NanLossModule.make(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=8))
    assert cb.report is not None
    (f,) = _loss_findings(cb.report)
    assert f.first_step == 2


class _NanLossOf(nn.Module):
    """The HF protocol, with a logged statistic that turns NaN at the 3rd forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        self.calls += 1
        loss = nn.functional.mse_loss(out, labels) + _aux(self.calls, 3).detach()
        return {"loss": loss, "logits": out}


def test_hf_trainer_loss_turning_nan(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = hf_train(_NanLossOf(), tmp_path)
    (f,) = _loss_findings(report)
    assert f.first_step == 2


# -- look-alikes ------------------------------------------------------------------------------


def test_finite_loss_is_silent() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        (nn.functional.mse_loss(model(x), y) + 0.1 * _aux(k, -1).detach()).backward()
        opt.step()

    assert not run_steps(model, opt, body, steps=5).by_check(ID)


def test_nan_loss_with_nan_gradients_is_nonfinite_grads() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.mse_loss(out, y)
        if k == 2:
            loss = loss + torch.sqrt(out - 100).mean()  # NaN through the graph, both ways
        loss.backward()
        opt.step()

    report = run_steps(model, opt, body, steps=4)
    assert report.by_check("nonfinite_grad")
    assert not _loss_findings(report)


def test_nan_validation_loss_never_backpropagated_is_silent() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            val = nn.functional.mse_loss(model(x), y) + _aux(k, 1)
            assert not torch.isfinite(val) or k != 1

    assert not run_steps(model, opt, body, steps=4).by_check(ID)


def test_note_loss_from_a_custom_loop() -> None:
    """A loop that calls ``torch.autograd.backward`` hands the loss to ``note_loss``."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k in range(4):
            x = torch.randn(8, DIM)
            opt.zero_grad()
            loss = model(x).pow(2).mean() + _aux(k, 1).detach()
            w.note_loss(loss)
            torch.autograd.backward([loss])
            opt.step()
    (f,) = _loss_findings(w.report())
    assert f.first_step == 1
