"""``clip_without_effect``: a clipping call that saw no gradient, so clipped nothing."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from _built import DIM, of
from torch import nn
from torch.nn.utils import clip_grad_norm_

import gradwatch
from gradwatch.checks.clip_without_effect import ClipWithoutEffect

ID = ClipWithoutEffect.id


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))


def _loop(
    model: nn.Module, opt: Any, clip: Callable[[], Any], before_backward: bool = False
) -> gradwatch.Report:
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt) as w:
        for _ in range(4):
            x, y = torch.randn(16, DIM, generator=gen), torch.randn(16, 2, generator=gen)
            opt.zero_grad(set_to_none=True)
            if before_backward:
                clip()
            nn.functional.mse_loss(model(x), y).backward()
            if not before_backward:
                clip()
            opt.step()
    return w.report()


def test_a_consumed_filter_is_an_error_at_its_line() -> None:
    model = _model()
    params = filter(lambda p: p.requires_grad, model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)  # reads the filter
    found = of(_loop(model, opt, lambda: clip_grad_norm_(params, 1.0)), ID)
    assert len(found) == 1 and found[0].severity == "error"
    assert found[0].count == 4
    assert found[0].details["called_at"].startswith("tests/checks/test_clip_without_effect.py:")


@pytest.mark.filterwarnings("ignore:`parameters` is an empty generator")
def test_a_generator_stored_once_clips_nothing_from_its_second_use() -> None:
    model = _model()
    params = model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3)
    found = of(_loop(model, opt, lambda: torch.nn.utils.clip_grad_norm_(params, 0.5)), ID)
    assert len(found) == 1


def test_clipping_before_backward_sees_no_gradient() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clip = lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    assert of(_loop(model, opt, clip, before_backward=True), ID)


@pytest.mark.parametrize(
    "clip",
    [
        lambda m, ps: clip_grad_norm_(ps, 1.0),  # a materialised list
        lambda m, ps: clip_grad_norm_(m.parameters(), 1.0),  # a fresh generator each time
        lambda m, ps: clip_grad_norm_(ps, 0.5, foreach=True),  # PPO: clips every step
        lambda m, ps: torch.nn.utils.clip_grad_value_(ps, 0.1),
        lambda m, ps: clip_grad_norm_(ps[0], 1.0),  # one tensor
    ],
)
def test_clips_that_see_gradients_are_silent(clip) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    assert not of(_loop(model, opt, lambda: clip(model, params)), ID)


def test_torch_is_itself_again_after_the_watch() -> None:
    real = torch.nn.utils.clip_grad._get_total_norm
    model = _model()
    _loop(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        lambda: clip_grad_norm_(model.parameters(), 1),
    )
    assert torch.nn.utils.clip_grad._get_total_norm is real
    assert not getattr(torch.nn.utils.clip_grad_value_, "_gradwatch_clip", False)
    grouping = torch.nn.utils.clip_grad._group_tensors_by_device_and_dtype
    assert not getattr(grouping, "_gradwatch_clip", False)


def test_clip_grad_value_bound_before_watching_is_seen() -> None:
    """``from torch.nn.utils import clip_grad_value_`` before watching (issue 51.7): the call
    is seen where torch groups its gradients, whatever name it was bound to, and told apart
    from ``clip_grad_norm_``'s own grouping."""
    from torch.nn.utils import clip_grad_value_

    from gradwatch.capture.loop.clip_calls import ClipCalls

    model = _model()
    nn.functional.mse_loss(model(torch.randn(4, DIM)), torch.randn(4, 2)).backward()
    calls = ClipCalls()
    calls.install()
    try:
        clip_grad_value_(model.parameters(), 0.1)
        clip_grad_norm_(model.parameters(), 1.0)  # groups too: counted once, as the norm
        assert calls.take() == (2, [])
        assert calls.calls == 0
    finally:
        calls.remove()
