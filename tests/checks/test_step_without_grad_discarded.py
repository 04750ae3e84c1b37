"""``step_without_grad`` with ``details.discarded_backward_passes``: ``zero_grad()`` inside a
gradient-accumulation loop, so each step used only the last micro-batch.

Bug forms: the optimizer's ``zero_grad()`` before every micro-batch, ``model.zero_grad()`` in
a per-batch helper, ``p.grad = None`` by hand, and Lightning manual optimization that
zeroes every batch but steps every second one. Clean: the same loops zeroing once per step,
token-count-normalised accumulation, a GAN, SAM, LBFGS, PCGrad, and Lightning's own
``accumulate_grad_batches`` (accelerate's and the HF Trainer's are in tests/integrations/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn

import gradwatch
from gradwatch.checks.step_without_grad import StepWithoutGrad

ACC = 4
MICRO = 16

Reset = Callable[[nn.Module, torch.optim.Optimizer], None]


def _opt_zero(m: nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()


def _model_zero(m: nn.Module, o: torch.optim.Optimizer) -> None:
    m.zero_grad()


def _by_hand(m: nn.Module, o: torch.optim.Optimizer) -> None:
    for p in m.parameters():
        p.grad = None


def _accumulate(reset_each: Reset | None, cfg: dict[str, Any] | None = None) -> gradwatch.Report:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config={**CFG, **(cfg or {})}) as w:
        for k, (x, y) in enumerate(batches(MICRO)):
            if reset_each is not None:
                reset_each(model, opt)  # the bug: inside the accumulation loop
            (nn.functional.mse_loss(model(x), y) / ACC).backward()
            if (k + 1) % ACC == 0:
                opt.step()
                if reset_each is None:
                    opt.zero_grad()
    return w.report()


def _discarded(report: gradwatch.Report) -> list[Any]:
    return [f.details.get("discarded_backward_passes") for f in report.by_check(StepWithoutGrad.id)]


@pytest.mark.parametrize("reset", [_opt_zero, _model_zero, _by_hand], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["every_hook", "default"])
def test_zero_grad_inside_accumulation_fires_once(reset: Reset, mode: str) -> None:
    cfg = {"trim_hooks_after": None} if mode == "every_hook" else {"trim_hooks_after": 2}
    report = _accumulate(reset, cfg)
    (f,) = report.by_check(StepWithoutGrad.id)
    assert f.severity == "error" and f.details["discarded_backward_passes"] == ACC - 1
    assert f.count == MICRO // ACC and "last backward pass" in f.message
    assert {x.check for x in report.findings} == {StepWithoutGrad.id}, report.findings


def test_zeroing_once_per_step_is_clean() -> None:
    assert _accumulate(None).findings == []


def test_token_count_normalised_accumulation_is_clean() -> None:
    """Sum of token losses per micro-batch, gradients divided by the total count at the end."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=CFG) as w:
        tokens = 0
        for k, (x, y) in enumerate(batches(MICRO)):
            n = 4 + k % 3
            nn.functional.mse_loss(model(x[:n]), y[:n], reduction="sum").backward()
            tokens += n
            if (k + 1) % ACC == 0:
                for p in model.parameters():
                    assert p.grad is not None
                    p.grad.div_(tokens)
                opt.step()
                opt.zero_grad()
                tokens = 0
    assert w.report().findings == []


def test_gan_sam_lbfgs_and_pcgrad_are_clean() -> None:
    # GAN: D's gradients from G's backward are dropped by D's zero_grad (after G stepped).
    g, d = mlp(4, 16, 8), mlp(8, 16, 1)
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    with gradwatch.watch(nn.ModuleDict({"g": g, "d": d}), [og, od], config=CFG) as w:
        for x, _ in batches(6):
            od.zero_grad()
            fake = g(torch.randn(16, 4))
            (d(x).mean() - d(fake.detach()).mean()).backward()
            od.step()
            og.zero_grad()
            d(fake).mean().backward()
            og.step()
    assert not fired(w.report(), "warning"), w.report().findings

    # SAM: the first pass's gradient perturbs the weights, is dropped, the second one steps.
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, base, config=CFG) as w:
        for x, y in batches(6):
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                for p, e in zip(model.parameters(), eps):
                    p.add_(e)
            base.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), eps):
                    p.sub_(e)
            base.step()
            base.zero_grad()
    assert not fired(w.report(), "warning"), w.report().findings

    model = mlp()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with gradwatch.watch(model, lbfgs, config=CFG) as w:
        for x, y in batches(4):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                lbfgs.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            lbfgs.step(closure)
    assert not fired(w.report(), "warning"), w.report().findings

    # PCGrad: one backward per task, each gradient kept and the gradient reset, the merged
    # projection written into .grad.
    model = mlp(8, 16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, _ in batches(6):
            out = model(x)
            task_grads = []
            for t in range(2):
                opt.zero_grad()
                out[:, t].square().mean().backward(retain_graph=t == 0)
                task_grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
            g1, g2 = (torch.cat([g.flatten() for g in gs]) for gs in task_grads)
            dot = torch.dot(g1, g2)
            if dot < 0:
                g1 = g1 - dot / g2.square().sum() * g2
            merged = g1 + g2
            offset = 0
            for p in params:
                p.grad = merged[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            opt.step()
    assert not fired(w.report(), "warning"), w.report().findings


def _lightning(tmp_path: Path, module: Any, **kw: Any) -> gradwatch.Report:
    from _lightning_helpers import loader, trainer

    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb, **kw).fit(module, loader())
    assert cb.report is not None
    return cb.report


def test_under_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import Regressor

    class ZeroEveryBatch(Regressor):
        """Manual optimization: zero_grad() every batch, step() every second one."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self(x), y))
            if (batch_idx + 1) % 2 == 0:
                opt.step()

    report = _lightning(tmp_path / "bug", ZeroEveryBatch(), max_steps=4, limit_train_batches=8)
    assert _discarded(report) == [1], report.findings
    clean = _lightning(tmp_path / "ok", Regressor(), accumulate_grad_batches=3, max_steps=3)
    assert clean.findings == [], clean.findings
