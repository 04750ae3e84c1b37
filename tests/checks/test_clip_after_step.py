"""``clip_after_step``: gradients clipped, scaled or noised after the step that used them.

Bug forms: ``clip_grad_norm_`` after ``step()``, ``clip_grad_value_`` after it with
``zero_grad()`` at the loop's end, DP noise added after the step, a clamp that replaces
``.grad``, a step post hook of the user's that clips, and under accelerate and Lightning.
Clean: the clip before the step (also with a GradScaler after ``unscale_``), gradient
logging after the step, SAM, LBFGS, and Lightning's own ``gradient_clip_val``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

import gradwatch
from gradwatch.checks.clip_after_step import ClipAfterStep

STEPS = 5

After = Callable[[nn.Module], None]


def _norm(m: nn.Module) -> None:
    clip_grad_norm_(m.parameters(), 0.1)


def _value(m: nn.Module) -> None:
    clip_grad_value_(m.parameters(), 0.01)


def _noise(m: nn.Module) -> None:
    for p in m.parameters():
        assert p.grad is not None
        p.grad.add_(torch.randn_like(p), alpha=0.01)  # DP noise, too late


def _clamp(m: nn.Module) -> None:
    for p in m.parameters():
        assert p.grad is not None
        p.grad = p.grad.clamp(-0.01, 0.01)


def _loop(after: After | None, before: After | None = None, zero_last: bool = False) -> Any:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(STEPS):
            if not zero_last:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if before is not None:
                before(model)
            opt.step()
            if after is not None:
                after(model)
            if zero_last:
                opt.zero_grad()
    return w.report()


@pytest.mark.parametrize("after", [_norm, _value, _noise, _clamp], ids=lambda f: f.__name__)
@pytest.mark.parametrize("zero_last", [False, True])
def test_an_edit_after_the_step_fires_once(after: After, zero_last: bool) -> None:
    report = _loop(after, zero_last=zero_last)
    (f,) = report.by_check(ClipAfterStep.id)
    assert f.severity == "error" and f.first_step == 0 and f.details["edited_params"] == 4
    assert f.count == STEPS - 1 and "after optimizer[0].step()" in f.message
    assert fired(report) == {ClipAfterStep.id}, report.findings


def test_a_step_post_hook_that_clips_runs_too_late() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=CFG) as w:
        opt.register_step_post_hook(lambda o, a, k: clip_grad_norm_(model.parameters(), 0.1))
        for x, y in batches(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert fired(w.report()) == {ClipAfterStep.id}


def test_clip_before_the_step_and_reading_after_it_are_clean() -> None:
    def log_norms(m: nn.Module) -> None:
        torch.stack([p.grad.norm() for p in m.parameters()])  # type: ignore[union-attr]

    assert _loop(log_norms, before=_norm).findings == []
    assert _loop(None, before=_value, zero_last=True).findings == []


def test_grad_scaler_unscale_then_clip_is_clean() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with gradwatch.watch(model, opt, config=CFG, scaler=scaler) as w:
        for x, y in batches(STEPS):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert not fired(w.report()), w.report().findings


def test_sam_and_lbfgs_are_clean() -> None:
    model = mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, base, config=CFG) as w:
        for x, y in batches(STEPS):
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
            clip_grad_norm_(model.parameters(), 1.0)
            base.step()
            base.zero_grad()
    assert not fired(w.report()), w.report().findings

    model = mlp()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with gradwatch.watch(model, lbfgs, config=CFG) as w:
        for x, y in batches(STEPS):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                lbfgs.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                clip_grad_norm_(model.parameters(), 1.0)
                return loss

            lbfgs.step(closure)
    assert not fired(w.report()), w.report().findings


def test_the_optimizer_gets_its_own_zero_grad_back() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=CFG):
        assert "zero_grad" in opt.__dict__
    assert "zero_grad" not in opt.__dict__


def test_under_accelerate() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def train(clip_late: bool) -> gradwatch.Report:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        net = mlp()
        model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05))
        with gradwatch.watch(model, opt, config=CFG) as w:
            for x, y in batches(8):
                with acc.accumulate(model):
                    acc.backward(nn.functional.mse_loss(model(x), y))
                    if not clip_late and acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 0.1)
                    opt.step()
                    if clip_late and acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 0.1)
                    opt.zero_grad()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        return w.report()

    late = train(clip_late=True)
    assert fired(late) == {ClipAfterStep.id}, late.findings
    assert late.by_check(ClipAfterStep.id)[0].count == 3  # 4 real steps, the last not judged
    assert not fired(train(clip_late=False))


def test_under_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import Regressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class ClipAtBatchEnd(Regressor):
        def on_train_batch_end(self, *args: Any) -> None:
            clip_grad_norm_(self.parameters(), 0.1)  # after Lightning's optimizer step

    def fit(module: Any, root: Path, **kw: Any) -> gradwatch.Report:
        cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
        trainer(root, cb, **kw).fit(module, loader())
        assert cb.report is not None
        return cb.report

    late = fit(ClipAtBatchEnd(), tmp_path / "late")
    assert fired(late) == {ClipAfterStep.id}, late.findings
    clean = fit(Regressor(), tmp_path / "ok", gradient_clip_val=0.1)
    assert not fired(clean), clean.findings
