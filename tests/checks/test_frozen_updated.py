"""``frozen_param_updated``: frozen weights an optimizer still moves; and its look-alikes."""

from __future__ import annotations

from typing import Callable

import torch
from _loops import batches, fired, mlp
from torch import nn

import gradwatch

Make = Callable[[nn.Module], torch.optim.Optimizer]


def _run(make_opt: Make, *, set_to_none: bool, freeze_at: int = 3, steps: int = 8):  # type: ignore[no-untyped-def]
    """Train, freeze the first block mid-run (after the optimizer was built), train on."""
    torch.manual_seed(0)
    model = nn.Sequential(mlp(8, 16, 8), nn.Linear(8, 1))
    opt = make_opt(model)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(steps)):
            if k == freeze_at:
                model[0].requires_grad_(False)
            opt.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def test_adamw_weight_decay_moves_weights_frozen_mid_run() -> None:
    report = _run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), set_to_none=False)
    (f,) = [f for f in report.by_check("frozen_param_updated") if f.module == "0.0"]
    assert f.severity == "error"
    assert set(f.params) == {"0.0.weight", "0.0.bias"}
    assert {f.module for f in report.by_check("frozen_param_updated")} == {"0.0", "0.2"}
    # the freeze is also seen as a layout change: frozen_in_optimizer speaks up mid-run
    assert {f.module for f in report.by_check("frozen_in_optimizer")} == {"0.0", "0.2"}
    assert "frozen_param_updated" in fired(report, "error")


def test_sgd_momentum_keeps_moving_weights_frozen_mid_run() -> None:
    report = _run(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), set_to_none=False
    )
    assert {f.module for f in report.by_check("frozen_param_updated")} == {"0.0", "0.2"}


def test_plain_sgd_does_not_move_frozen_weights() -> None:
    # zero gradients, no momentum, no weight decay: p - lr * 0 == p, nothing to report
    report = _run(lambda m: torch.optim.SGD(m.parameters(), lr=0.05), set_to_none=False)
    assert not report.by_check("frozen_param_updated")
    assert report.by_check("frozen_in_optimizer")


def test_adamw_skips_frozen_params_whose_grad_is_none() -> None:
    # set_to_none=True: the frozen parameters' .grad stays None and AdamW skips them
    report = _run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), set_to_none=True)
    assert not report.by_check("frozen_param_updated")


def test_frozen_block_in_eval_mode_not_in_any_optimizer() -> None:
    torch.manual_seed(0)
    backbone, head = mlp(8, 16, 8), nn.Linear(8, 1)
    backbone.requires_grad_(False)
    backbone.eval()
    model = nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, weight_decay=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(6):
            opt.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    report = w.report()
    assert not report.by_check("frozen_param_updated")
    assert not fired(report, "info")


def test_a_frozen_param_moved_by_hand_inside_the_step_window() -> None:
    # One element of a frozen, optimizer-held weight changed by a tiny amount in the step:
    # the exact change detection must not miss it.
    torch.manual_seed(0)
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def nudge(*_: object) -> None:
        with torch.no_grad():
            model[0].weight[3, 5] += 1e-7

    opt.register_step_post_hook(nudge)  # registered first: runs before gradwatch's own hook
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    (f,) = w.report().by_check("frozen_param_updated")
    assert f.params == ["0.weight"]
