"""gradwatch's ``with_kwargs`` module hooks accept torch's call without ``kwargs`` too.

``Module._call_impl`` snapshots a module's hooks, then asks per hook whether it is in
``_forward_hooks_with_kwargs``; a handle removed by another thread in between (the
auto-probes' first-batch hook removes itself after one call) is called as a plain hook. In
CI four threads running forwards raised ``FirstCall._post() missing 1 required positional
argument: 'output'`` inside the user's forward. Here every hook gradwatch holds on the model
is called both ways, as that race calls it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradwatch
from gradwatch.model.hook_args import post_args, pre_kwargs


def test_the_helpers_read_both_calls() -> None:
    assert pre_kwargs(({"mask": 1},)) == {"mask": 1} and pre_kwargs(()) == {}
    assert post_args(({"mask": 1}, "out")) == ({"mask": 1}, "out")
    assert post_args(("out",)) == ({}, "out")


def _call_both_ways(model: nn.Module, x: torch.Tensor) -> int:
    """Call each ``with_kwargs`` hook on ``model`` with and without its kwargs: how many."""
    out = model(x)
    calls = 0
    for m in model.modules():
        for hook_id, hook in list(m._forward_pre_hooks.items()):
            if hook_id in m._forward_pre_hooks_with_kwargs:
                hook(m, (x,))
                hook(m, (x,), {})
                calls += 1
        for hook_id, hook in list(m._forward_hooks.items()):
            if hook_id in m._forward_hooks_with_kwargs:
                hook(m, (x,), out)
                hook(m, (x,), {}, out)
                calls += 1
    for hook_id, hook in list(nn.modules.module._global_forward_hooks.items()):
        if hook_id in nn.modules.module._global_forward_hooks_with_kwargs:
            hook(model, (x,), out)
            hook(model, (x,), {}, out)
            calls += 1
    return calls


def test_every_hook_on_a_watched_model_takes_either_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    errors: list[Any] = []
    cfg = {"every_n_steps": 1, "on_internal_error": "raise"}
    with gradwatch.watch(model, opt, config=cfg) as w:
        x = torch.randn(4, 8)
        seen.append(_call_both_ways(model, x))  # before the first forward: FirstCall's hooks
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            seen.append(_call_both_ways(model, x))
    assert seen[0] > 0, "the first-batch hooks were expected on the model before its forward"
    assert not errors and not w.report().by_check("internal_error")
