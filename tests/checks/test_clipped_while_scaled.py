"""``clipped_while_scaled``: gradients clipped or edited before ``GradScaler.unscale_``.

Real loops: each real form of the bug fires, its look-alikes stay silent.
"""

from __future__ import annotations

import pytest
import torch
from _check_loops import errors_of as _errors
from _check_loops import run_steps as _run
from _loops import fired, mlp
from torch import nn

import gradwatch


def _amp_loop(order: str, steps: int = 4, inf_at: int = -1) -> gradwatch.Report:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if k == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if order == "clip_then_unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(opt)
        elif order == "clip_then_step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif order == "noise_then_step":
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p.grad) * 1e-3)
        elif order == "unscale_then_clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return _run(model, opt, body, steps=steps, scaler=scaler)


@pytest.mark.parametrize("order", ["clip_then_unscale", "clip_then_step", "noise_then_step"])
def test_gradients_edited_while_scaled(order: str) -> None:
    report = _amp_loop(order)
    (f,) = report.by_check("clipped_while_scaled")
    assert f.severity == "error" and f.count == 4
    assert len(f.params) == 4 and "unscale_" in f.hint


@pytest.mark.parametrize("order", ["unscale_then_clip", "plain"])
def test_unscale_then_clip_and_plain_amp_are_fine(order: str) -> None:
    report = _amp_loop(order)
    assert _errors(report) == set(), [f.line() for f in report.findings]
    assert "clipped_while_scaled" not in fired(report, "info")


def test_grad_scaler_skipping_inf_steps_is_fine() -> None:
    report = _amp_loop("unscale_then_clip", steps=5, inf_at=2)
    assert report.skipped_steps == 1
    assert "clipped_while_scaled" not in fired(report, "info")
    assert _errors(report) == set()


def test_scaler_method_restored_on_exit() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with gradwatch.watch(model, opt, scaler=scaler):
        assert "unscale_" in vars(scaler)
    assert "unscale_" not in vars(scaler)
