"""``loss_disconnected`` judged per optimizer when several models share one watched container.

Bug forms: a GAN's generator loss through ``D(G(z).detach())``, an encoder whose output is
detached before the decoder while the encoder's optimizer steps, and the same GAN bug under
Lightning (manual optimization). Clean: the GAN as written, D-phase fakes made under
``no_grad``, and an alternating schedule that trains one model per iteration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn

import gradwatch
from gradwatch.checks.loss_disconnected import LossDisconnected

STEPS = 6
sp = nn.functional.softplus


def _gan(detach_g: bool, d_fakes_no_grad: bool = False) -> gradwatch.Report:
    g, d = mlp(4, 16, 8), mlp(8, 16, 1)
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    with gradwatch.watch(nn.ModuleDict({"g": g, "d": d}), [og, od], config=CFG) as w:
        for x, _ in batches(STEPS):
            od.zero_grad()
            with torch.set_grad_enabled(not d_fakes_no_grad):
                fake = g(torch.randn(16, 4))
            (sp(-d(x)).mean() + sp(d(fake.detach())).mean()).backward()
            od.step()
            og.zero_grad()
            if d_fakes_no_grad:
                fake = g(torch.randn(16, 4))
            sp(-d(fake.detach() if detach_g else fake)).mean().backward()
            og.step()
    return w.report()


def test_a_generator_step_through_a_detached_fake_fires_for_the_generator() -> None:
    report = _gan(detach_g=True)
    (f,) = report.by_check(LossDisconnected.id)
    assert f.severity == "error" and f.details == {"cause": "disconnected", "optimizer": 0}
    assert all(p.startswith("g.") for p in f.params) and len(f.params) == 4
    assert fired(report, "error") == {LossDisconnected.id}, report.findings


def test_an_encoder_cut_off_by_a_detach_fires_for_the_encoder() -> None:
    model = nn.ModuleDict({"enc": mlp(8, 16, 16), "dec": mlp(16, 16, 1)})
    opts = [torch.optim.AdamW(model[k].parameters(), 1e-3) for k in ("enc", "dec")]
    with gradwatch.watch(model, opts, config=CFG) as w:
        for x, y in batches(STEPS):
            for o in opts:
                o.zero_grad()
            z = model["enc"](x).detach()  # a stop-gradient left in by mistake
            nn.functional.mse_loss(model["dec"](z), y).backward()
            for o in opts:
                o.step()
    (f,) = w.report().by_check(LossDisconnected.id)
    assert f.details["optimizer"] == 0 and all(p.startswith("enc.") for p in f.params)


def test_correct_gans_and_alternating_phases_are_clean() -> None:
    assert not _gan(detach_g=False).by_check(LossDisconnected.id)
    assert not _gan(detach_g=False, d_fakes_no_grad=True).by_check(LossDisconnected.id)
    g, d = mlp(4, 16, 8), mlp(8, 16, 1)
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    with gradwatch.watch(nn.ModuleDict({"g": g, "d": d}), [og, od], config=CFG) as w:
        for k, (x, _) in enumerate(batches(2 * STEPS)):
            if k % 2 == 0:  # D's turn: G only makes fakes, under no_grad
                od.zero_grad()
                with torch.no_grad():
                    fake = g(torch.randn(16, 4))
                (sp(-d(x)).mean() + sp(d(fake)).mean()).backward()
                od.step()
            else:
                og.zero_grad()
                sp(-d(g(torch.randn(16, 4)))).mean().backward()
                og.step()
    assert not fired(w.report()), w.report().findings


def test_under_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import GAN, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class DetachedGenerator(GAN):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            real, _ = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(real.shape[0], 4)
            bce = nn.functional.binary_cross_entropy_with_logits
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            opt_g.zero_grad()
            fake = self.generator(z)
            self.manual_backward(bce(self.discriminator(fake.detach()), ones))  # the bug
            opt_g.step()
            opt_d.zero_grad()
            d_loss = bce(self.discriminator(real), ones) + bce(
                self.discriminator(fake.detach()), zeros
            )
            self.manual_backward(d_loss)
            opt_d.step()

    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(DetachedGenerator(), loader())
    assert cb.report is not None
    (f,) = cb.report.by_check(LossDisconnected.id)
    assert f.details["optimizer"] == 0 and all(p.startswith("generator.") for p in f.params)
