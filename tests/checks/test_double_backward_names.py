"""``double_backward`` names the parameters that got the repeated gradient: one finding.

Three forms where the answer is not "every parameter": a fine-tune whose frozen backbone the
repeated loss never reaches, a GAN whose discriminator loss is backpropagated twice (the
generator's step is clean), and a Lightning module with two ``manual_backward`` of one loss
on a model with a frozen embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _check_loops import CFG
from _loops import batches, mlp
from torch import nn

import gradwatch
from gradwatch.checks.double_backward import DoubleBackward


def _finding(report: gradwatch.Report) -> gradwatch.Finding:
    (f,) = report.by_check(DoubleBackward.id)
    return f


def test_a_fine_tune_names_the_head_not_the_frozen_backbone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(mlp(8, 16, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=1e-3)

    def compute_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)  # the helper already backpropagates
        return loss

    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(4, out=2):
            opt.zero_grad()
            compute_loss(x, y).backward()  # and the loop again
            opt.step()
    f = _finding(w.report())
    assert set(f.params) == {"1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}
    assert f.module == "1" and f.details["modules"] == ["1"]
    assert "4 parameter(s) of '1'" in f.message and "2x their gradient" in f.message


def test_a_gan_names_the_discriminator_only() -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.functional.binary_cross_entropy_with_logits
    with gradwatch.watch({"G": G, "D": D}, {"G": opt_g, "D": opt_d}, config=CFG) as w:
        for real, _ in batches(4):
            z = torch.randn(real.shape[0], 4)
            fake = G(z)
            opt_d.zero_grad()
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
            d_loss.backward(retain_graph=True)  # to log D's gradient norm
            torch.nn.utils.clip_grad_norm_(D.parameters(), float("inf"))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(D(fake), ones).backward()
            opt_g.step()
    f = _finding(w.report())
    assert set(f.params) == {"D:0.weight", "D:0.bias", "D:2.weight", "D:2.bias"}
    assert f.details["optimizer"] == 1 and "optimizer['D']" in f.message


def test_lightning_manual_backward_twice_names_the_trained_layers(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import ManualRegressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class FrozenInput(ManualRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.body[0].requires_grad_(False)  # a pretrained input projection, kept fixed

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss, retain_graph=True)  # for a gradient-norm log
            self.manual_backward(loss)
            opt.step()

    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(FrozenInput(), loader())
    assert cb.report is not None
    f = _finding(cb.report)
    assert set(f.params) == {"body.2.weight", "body.2.bias"}
    assert f.module == "body.2"
