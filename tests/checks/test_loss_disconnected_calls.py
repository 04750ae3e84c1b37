"""A loss that never reaches the model: the backward() calls are counted and said.

No gradient hook fires for a backward that reaches no watched parameter, so the report's
``backward_passes`` stays 0; the summary used to read "no backward pass" after 30 of them.
``Tensor.backward`` itself is seen, so the calls are counted (``details.backward_calls``)
and the summary says they did not reach the model. Three forms: a loss rebuilt from
``.tolist()``, a logging helper's float wrapped back into a tensor, and a Lightning
``training_step`` returning such a tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _loops import batches, mlp
from torch import nn

import gradwatch
from gradwatch.checks.loss_disconnected import LossDisconnected

ID = LossDisconnected.id
STEPS = 30

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _from_list(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(torch.tensor(pred.tolist(), requires_grad=True), y)


def _logged_float(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    value = nn.functional.mse_loss(pred, y).item()  # a helper that returns the logged number
    return torch.tensor(value, requires_grad=True)


def _plain(loss_of: Loss) -> gradwatch.Report:
    torch.manual_seed(0)
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for x, y in batches(STEPS):
            opt.zero_grad()
            loss_of(model(x), y).backward()
            opt.step()
    return w.report()


@pytest.mark.parametrize("loss_of", [_from_list, _logged_float])
def test_backward_calls_that_reach_nothing_are_counted(loss_of: Loss) -> None:
    report = _plain(loss_of)
    assert report.steps == STEPS and report.backward_passes == 0
    (f,) = report.by_check(ID)
    assert f.details["backward_calls"] == STEPS and f.count == STEPS
    assert f"backward() ran {STEPS} times and reached none of them" in f.message
    assert f"({STEPS} backward() calls, none reached the model)" in report.summary()


def test_a_lightning_training_step_returning_a_rebuilt_loss(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import Regressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class Rebuilt(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return torch.tensor(loss.item(), requires_grad=True)  # the bug

    cb = GradWatchCallback(config={"warn": False}, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(Rebuilt(), loader())
    report = cb.report
    assert report is not None and report.backward_passes == 0
    (f,) = report.by_check(ID)
    assert f.details["backward_calls"] == report.steps > 0
    assert f"({report.steps} backward() calls, none reached the model)" in report.summary()
