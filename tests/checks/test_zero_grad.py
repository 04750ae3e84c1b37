"""missing_zero_grad and step_without_grad: fire on the bug, silent on every correct reset."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from _loops import batches, fired, mlp
from torch import nn

import gradwatch
from gradwatch.checks.not_observed import NotObserved

Reset = Callable[[nn.Module, torch.optim.Optimizer], None]


def _loop(reset: Reset, *, steps: int = 5, opt_cls: type = torch.optim.SGD) -> gradwatch.Report:
    torch.manual_seed(0)
    model = mlp()
    opt = opt_cls(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(steps)):
            if k:
                reset(model, opt)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def _manual_none(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = None


def _data_zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()  # legacy idiom: does not bump the version counter


def _detach_zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()


def _new_zeros(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _mul_zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(0)


def _foreach_zero(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch._foreach_zero_([p.grad for p in model.parameters()])


CORRECT_RESETS: dict[str, Reset] = {
    "opt.zero_grad()": lambda m, o: o.zero_grad(),
    "opt.zero_grad(set_to_none=False)": lambda m, o: o.zero_grad(set_to_none=False),
    "model.zero_grad()": lambda m, o: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda m, o: m.zero_grad(set_to_none=False),
    "p.grad = None": _manual_none,
    "p.grad.data.zero_()": _data_zero,
    "p.grad.detach_(); zero_()": _detach_zero,
    "p.grad = zeros_like": _new_zeros,
    "p.grad.mul_(0)": _mul_zero,
    "_foreach_zero_": _foreach_zero,
}


@pytest.mark.parametrize("name", list(CORRECT_RESETS))
def test_every_correct_reset_is_silent(name: str) -> None:
    report = _loop(CORRECT_RESETS[name])
    assert fired(report, "info") == set(), [f.line() for f in report.findings]


def test_never_zeroing_fires_from_the_second_step() -> None:
    report = _loop(lambda m, o: None)
    (finding,) = report.by_check("missing_zero_grad")
    assert finding.severity == "error"
    assert set(finding.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert finding.first_step == 1 and finding.last_step == 4 and finding.count == 4
    assert "zero_grad" in finding.hint
    assert report.failed


def test_zeroing_once_with_set_to_none_false_then_never() -> None:
    calls = {"n": 0}

    def once(m: nn.Module, o: torch.optim.Optimizer) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            o.zero_grad(set_to_none=False)

    report = _loop(once)
    (finding,) = report.by_check("missing_zero_grad")
    assert finding.first_step == 2


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_missing_zero_grad_with_other_optimizers(opt_cls: type) -> None:
    report = _loop(lambda m, o: None, opt_cls=opt_cls)
    assert "missing_zero_grad" in fired(report)


def test_clip_and_grad_scaler_unscale_between_backward_and_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}, scaler=scaler) as w:
        for x, y in batches(6):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
    report = w.report()
    assert fired(report, "info") == set(), [f.line() for f in report.findings]
    assert report.steps == 6


def test_accumulation_without_zeroing_between_steps_fires() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(8)):
            nn.functional.mse_loss(model(x), y).backward()
            if k % 2 == 1:
                opt.step()  # zero_grad forgotten after the step
    (finding,) = w.report().by_check("missing_zero_grad")
    assert finding.first_step == 1


def test_zero_grad_between_backward_and_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.zero_grad()  # wrong place: the step sees no gradient
            opt.step()
    report = w.report()
    assert fired(report) == {"step_without_grad"}
    (finding,) = report.by_check("step_without_grad")
    assert finding.severity == "error" and finding.count == 3
    assert set(finding.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_zero_grad_set_to_none_false_between_backward_and_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.zero_grad(set_to_none=False)
            opt.step()
    assert "step_without_grad" in fired(w.report())


def test_step_without_any_backward_is_not_step_without_grad() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        opt.step()
        opt.step()
    # No step_without_grad; but the model never ran, so nothing was checked (issue 32).
    report = w.report()
    assert fired(report, "info") == {NotObserved.id}
    assert [f.details["reason"] for f in report.by_check(NotObserved.id)] == ["never_ran"]


def test_forgetting_zero_grad_after_the_hooks_are_trimmed_is_still_caught() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"every_n_steps": 1, "trim_hooks_after": 3}
    with gradwatch.watch(model, opt, config=cfg) as w:
        for k, (x, y) in enumerate(batches(10)):
            if k < 5:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if k == 4:
                # a clean loop keeps one value-check hook: the first parameter to arrive
                assert list(w._hooks.pre) == [3]
    (finding,) = w.report().by_check("missing_zero_grad")
    # Step 5 is the first without a reset: the trimmed parameters' gradients are looked at
    # once when the backward starts (capture/grads/resets.py), so it is seen at once.
    assert finding.first_step == 5 and finding.last_step == 9
    assert finding.params == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("name", ["p.grad.data.zero_()", "opt.zero_grad(set_to_none=False)"])
def test_long_correct_loops_stay_silent_after_the_trim(name: str) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "trim_hooks_after": 2}) as w:
        for k, (x, y) in enumerate(batches(12)):
            if k:
                CORRECT_RESETS[name](model, opt)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        kept = len(w._hooks.pre)
    assert fired(w.report(), "info") == set()
    # .data.zero_() cannot be told from a forgotten reset by the version counter: its
    # parameters keep the value check; zero_() bumps the counter and needs none, except
    # the parameter that arrives first in each backward (capture/grads/resets.py looks at the others).
    assert kept == (4 if name == "p.grad.data.zero_()" else 1)
