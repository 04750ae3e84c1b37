"""No global module hook of gradwatch's outlives its watcher (torch.compile warns of any, and
every module call in the process takes the global-hook path while one is there)."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch


def test_no_global_module_hook_is_left_after_the_scan_steps_or_exit() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Softmax(dim=-1), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not nn.modules.module._has_any_global_hook()
    with gradwatch.watch(model, opt):
        for _ in range(3):  # inside the scan steps: the loss-graph observer is on
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert not nn.modules.module._has_any_global_hook()
