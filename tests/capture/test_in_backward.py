"""The optimizer-in-backward pattern (PyTorch tutorial "How to save memory by fusing the
optimizer step into the backward pass"): one optimizer per parameter, stepped and cleared in
``register_post_accumulate_grad_hook``. Each step runs inside the backward; its gradient is
read there, so the backward passes are counted and the steps judged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradwatch

STEPS = 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))


def _fused(model: nn.Module, *, hooks_first: bool, nan_at: int = -1, config: Any = None) -> Any:
    opts = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def optimizer_hook(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles: list[Any] = []
    if hooks_first:  # the tutorial's order: the hooks exist before watch()
        handles = [p.register_post_accumulate_grad_hook(optimizer_hook) for p in model.parameters()]
    with gradwatch.watch(model, list(opts.values()), config=config) as w:
        if not hooks_first:
            handles = [
                p.register_post_accumulate_grad_hook(optimizer_hook) for p in model.parameters()
            ]
        for s in range(STEPS):
            x = torch.randn(4, 6)
            if s == nan_at:
                x[0, 0] = float("nan")
            model(x).square().mean().backward()
    for h in handles:
        h.remove()
    return w.report()


def test_optimizer_in_backward_is_observed_and_clean() -> None:
    for hooks_first in (True, False):
        for config in (None, {"every_n_steps": 1, "trim_hooks_after": None}):
            report = _fused(_model(), hooks_first=hooks_first, config=config)
            assert report.findings == [], (hooks_first, report.findings)
            assert report.backward_passes == STEPS and report.steps == 4 * STEPS


def test_optimizer_in_backward_still_finds_a_nan() -> None:
    report = _fused(_model(), hooks_first=True, nan_at=3)
    assert {f.check for f in report.findings} == {"nonfinite_grad"}, report.findings
    assert min(f.first_step for f in report.findings) == 3
