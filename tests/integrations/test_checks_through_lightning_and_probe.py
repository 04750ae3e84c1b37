"""The newer checks through the Lightning callback (real Trainer) and the CLI Probe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_helpers import DIM, Regressor, loader, problems, trainer
from torch import nn

import gradwatch
from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

CFG = {"every_n_steps": 1}


class ItemLoss(Regressor):
    """``training_step`` rebuilds the loss from ``.item()``; with ``skip``, odd batches skip."""

    def __init__(self, skip_only: bool = False) -> None:
        super().__init__()
        self.skip_only = skip_only

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.skip_only:
            return None if batch_idx % 2 else loss  # Lightning's documented way to skip
        return torch.tensor(loss.item(), requires_grad=True)


class SharedEncoder(Regressor):
    """Manual optimization: an encoder held by both optimizers, both step per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head2 = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        x, y = batch
        h = self.body[1](self.body[0](x))
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = nn.functional.mse_loss(self.body[2](h), y) + self.head2(h).pow(2).mean()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        enc = list(self.body[0].parameters())
        return [
            torch.optim.SGD(enc + list(self.body[2].parameters()), lr=0.01),
            torch.optim.Adam(enc + list(self.head2.parameters()), lr=1e-3),
        ]


class ListBlocks(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.extra = [nn.Linear(1, 1)]  # a plain list: never registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra[0](self.body(x))


def _fit(tmp_path: Path, module: Any, **kw: Any) -> gradwatch.Report:
    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb, **kw).fit(module, loader())
    assert cb.report is not None
    return cb.report


@pytest.mark.slow
def test_lightning_item_loss_is_disconnected(tmp_path: Path) -> None:
    report = _fit(tmp_path, ItemLoss())
    (f,) = report.by_check("loss_disconnected")
    assert f.details["cause"] == "disconnected" and f.count == 6


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*training_step. returned .None.*")
def test_lightning_training_step_returning_none_is_not_disconnected(tmp_path: Path) -> None:
    report = _fit(tmp_path, ItemLoss(skip_only=True))
    assert "loss_disconnected" not in {f.check for f in report.findings}
    assert problems(report) == []


@pytest.mark.slow
def test_lightning_shared_encoder_double_update(tmp_path: Path) -> None:
    report = _fit(tmp_path, SharedEncoder())
    (f,) = report.by_check("double_update")
    assert set(f.params) == {"body.0.weight", "body.0.bias"}
    assert [o["class"] for o in f.details["optimizers"]] == ["SGD", "Adam"]


@pytest.mark.slow
def test_lightning_unregistered_layer(tmp_path: Path) -> None:
    report = _fit(tmp_path, ListBlocks())
    (f,) = report.by_check("unregistered_param")
    assert f.params == ["extra[0].weight", "extra[0].bias"]


@pytest.mark.slow
def test_lightning_amp_clipping_is_not_clipped_while_scaled(tmp_path: Path) -> None:
    from pytorch_lightning.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    report = _fit(tmp_path, Regressor(), plugins=[plugin], gradient_clip_val=0.5)
    assert "clipped_while_scaled" not in {f.check for f in report.findings}
    assert problems(report) == []


# -- the CLI Probe ---------------------------------------------------------------------------


def test_probe_reports_a_loss_rebuilt_from_item() -> None:
    model = nn.Sequential(nn.Linear(DIM, 4), nn.Tanh(), nn.Linear(4, 1))
    probe = gradwatch.Probe(
        model=model,
        batch=(torch.randn(8, DIM), torch.randn(8, 1)),
        loss_fn=lambda m, b: torch.tensor(
            nn.functional.mse_loss(m(b[0]), b[1]).item(), requires_grad=True
        ),
    )
    report = probe.run(steps=3)
    assert report.failed
    (f,) = report.by_check("loss_disconnected")
    assert f.details["cause"] == "disconnected"


def test_probe_reports_unregistered_layers() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(DIM, 4)
            self.heads = {"reg": nn.Linear(4, 1)}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.heads["reg"](self.inp(x))

    probe = gradwatch.Probe(
        model=Net(),
        batch=(torch.randn(8, DIM), torch.randn(8, 1)),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    (f,) = probe.run(steps=2).by_check("unregistered_param")
    assert f.params == ["heads['reg'].weight", "heads['reg'].bias"]


def test_probe_clean_model_has_none_of_the_new_findings() -> None:
    model = nn.Sequential(nn.Linear(DIM, 4), nn.Tanh(), nn.Linear(4, 1))
    probe = gradwatch.Probe(
        model=model,
        batch=(torch.randn(8, DIM), torch.randn(8, 1)),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    report = probe.run(steps=3)
    assert not report.failed and report.findings == []


class ClipBeforeUnscale(Regressor):
    """Manual optimization under 16-mixed: clips the still-scaled gradients itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)  # before the scaler unscaled
        opt.step()


@pytest.mark.slow
def test_lightning_manual_clip_before_unscale_is_clipped_while_scaled(tmp_path: Path) -> None:
    from pytorch_lightning.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    report = _fit(tmp_path, ClipBeforeUnscale(), plugins=[plugin])
    (f,) = report.by_check("clipped_while_scaled")
    assert f.count >= 5 and len(f.params) == 4
