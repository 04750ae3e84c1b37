"""``stale_param`` with ``details.cause: never_stepped``: an optimizer whose parameters get
gradients never steps while another watched optimizer does.

Bug forms: a GAN's generator step forgotten, its discriminator step forgotten, a
fine-tuning loop with a second optimizer for the head that is never stepped, and a
Lightning GAN (manual optimization) missing one ``step()``. Clean: the GAN as written, and an
optimizer that never steps because its parameters get no gradient yet (a later phase).
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
from gradwatch.checks.stale import StaleParam

STEPS = 6


def _gan(step_g: bool = True, step_d: bool = True) -> gradwatch.Report:
    g, d = mlp(4, 16, 8), mlp(8, 16, 1)
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    sp = nn.functional.softplus
    with gradwatch.watch(nn.ModuleDict({"g": g, "d": d}), [og, od], config=CFG) as w:
        for x, _ in batches(STEPS):
            od.zero_grad()
            fake = g(torch.randn(16, 4))
            (sp(-d(x)).mean() + sp(d(fake.detach())).mean()).backward()
            if step_d:
                od.step()
            og.zero_grad()
            sp(-d(fake)).mean().backward()
            if step_g:
                og.step()
    return w.report()


def _never(report: gradwatch.Report) -> list[Any]:
    return [f for f in report.by_check(StaleParam.id) if f.details.get("cause") == "never_stepped"]


@pytest.mark.parametrize("forgotten", ["g", "d"])
def test_a_gan_with_one_step_forgotten(forgotten: str) -> None:
    report = _gan(step_g=forgotten != "g", step_d=forgotten != "d")
    (f,) = _never(report)
    assert f.severity == "error" and f.details["optimizer"] == (0 if forgotten == "g" else 1)
    assert all(p.startswith(f"{forgotten}.") for p in f.params) and len(f.params) == 4
    assert "never stepped" in f.message
    assert fired(report, "error") == {StaleParam.id}, report.findings


def test_a_head_optimizer_never_stepped() -> None:
    model = nn.ModuleDict({"body": mlp(8, 16, 16), "head": nn.Linear(16, 1)})
    body_opt = torch.optim.AdamW(model["body"].parameters(), lr=1e-4)
    head_opt = torch.optim.AdamW(model["head"].parameters(), lr=1e-2)
    with gradwatch.watch(model, [body_opt, head_opt], config=CFG) as w:
        for x, y in batches(STEPS):
            body_opt.zero_grad()
            head_opt.zero_grad()
            nn.functional.mse_loss(model["head"](model["body"](x)), y).backward()
            body_opt.step()  # head_opt.step() forgotten
    (f,) = _never(w.report())
    assert sorted(f.params) == ["head.bias", "head.weight"] and f.details["optimizer"] == 1


def test_a_correct_gan_and_a_later_phase_optimizer_are_clean() -> None:
    assert not _never(_gan()) and not fired(_gan(), "warning")
    model = nn.ModuleDict({"body": mlp(8, 16, 1), "later": nn.Linear(8, 8)})
    opts = [torch.optim.SGD(model[k].parameters(), lr=0.05) for k in ("body", "later")]
    with gradwatch.watch(model, opts, config=CFG) as w:
        for x, y in batches(STEPS):
            opts[0].zero_grad()
            nn.functional.mse_loss(model["body"](x), y).backward()
            opts[0].step()  # "later" trains in a phase this run never reached
    assert not _never(w.report())


def test_a_lightning_gan_missing_a_step(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import GAN, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class NoGeneratorStep(GAN):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_g, _ = self.optimizers()
            opt_g.step = lambda *a, **k: None  # type: ignore[method-assign]  # "forgotten"
            super().training_step(batch, batch_idx)

    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(NoGeneratorStep(), loader())
    assert cb.report is not None
    (f,) = _never(cb.report)
    assert f.details["optimizer"] == 0 and all(p.startswith("generator.") for p in f.params)
