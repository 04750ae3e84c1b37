"""Runs where nothing trained never pass, whatever else was said (issue 44.2).

- A ``torch.compile``d model doing backward without ever calling ``optimizer.step()``: the
  ``info`` note that the forward is compiled (a partial blind spot) must not stand in for the
  forgotten step, which fails the run as it does uncompiled.
- A GradScaler that skipped every step (an inf loss on every batch): the model never changed.
  A scaler that skips some steps is still fine.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from _loops import batches, mlp
from torch import nn

import gradwatch


def _reasons(report: gradwatch.Report) -> dict[str, str]:
    return {f.details.get("reason", ""): f.severity for f in report.by_check("not_observed")}


def _no_step_run(model: nn.Module, opt: torch.optim.Optimizer) -> gradwatch.Report:
    with gradwatch.watch(model, opt) as w:
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # ... and never opt.step()
    return w.report()


@pytest.mark.slow  # torch.compile: ~5 s on CPU, even with the aot_eager backend
def test_a_compiled_model_that_never_steps_is_no_pass() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = cast(nn.Module, torch.compile(model, backend="aot_eager"))
    report = _no_step_run(compiled, opt)
    assert report.failed
    assert _reasons(report).get("no_step") == "error"


def test_the_same_loop_uncompiled_fails_the_same_way() -> None:
    model = mlp()
    report = _no_step_run(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert report.failed and _reasons(report) == {"no_step": "error"}


def _scaled_run(inf_at: set[int], steps: int = 4) -> gradwatch.Report:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with gradwatch.watch(model, opt, scaler=scaler) as w:
        for i, (x, y) in enumerate(batches(steps)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if i in inf_at:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return w.report()


def test_a_scaler_skipping_every_step_is_no_pass() -> None:
    report = _scaled_run(inf_at={0, 1, 2, 3})
    assert report.skipped_steps == 4 and report.steps == 0
    assert report.failed and _reasons(report) == {"all_steps_skipped": "error"}
    found = report.by_check("not_observed")[0]
    assert "never changed" in found.message and found.details["skipped_steps"] == 4


@pytest.mark.parametrize("inf_at", [{0}, {1, 2}])
def test_a_scaler_skipping_some_steps_still_passes(inf_at: set[int]) -> None:
    report = _scaled_run(inf_at)
    assert report.skipped_steps == len(inf_at)
    assert not report.failed and not report.by_check("not_observed")
