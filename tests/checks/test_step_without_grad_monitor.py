"""``step_without_grad`` (``discarded_backward_passes``) and gradient monitors: no false alarm.

A monitor backpropagates a loss with ``retain_graph=True``, reads the gradients (norms, a
per-task gradient's share), clears them on purpose with ``zero_grad()``, then runs the real
backward of the same forward and steps: no micro-batch was discarded. Three look-alikes: a
per-layer gradient-norm monitor, a multi-task loop that measures one task's gradient before
the total loss's backward, and the same monitor in a Lightning module with manual
optimization. Accumulation with ``zero_grad()`` inside the loop (a new forward per
micro-batch) still fires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn

import gradwatch
from gradwatch.checks.step_without_grad import StepWithoutGrad

ID = StepWithoutGrad.id


def test_a_gradient_norm_monitor_is_not_a_discarded_micro_batch() -> None:
    torch.manual_seed(0)
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms: list[torch.Tensor] = []
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(5):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(retain_graph=True)  # the monitor's pass
            norms.append(torch.stack([p.grad.norm() for p in model.parameters()]))  # type: ignore[union-attr]
            opt.zero_grad()  # cleared on purpose
            loss.backward()
            opt.step()
    report = w.report()
    assert not report.by_check(ID), [f.line() for f in report.findings]
    assert fired(report, "error") == set()


def test_measuring_one_tasks_gradient_before_the_total_is_not_discarded() -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    shares: list[float] = []
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(5):
            opt.zero_grad()
            h = trunk(x)
            task_a = nn.functional.mse_loss(heads[0](h), y)
            task_b = nn.functional.l1_loss(heads[1](h), y)
            task_a.backward(retain_graph=True)  # task A's gradient on the shared trunk
            g_a = torch.cat([p.grad.flatten() for p in trunk.parameters()])  # type: ignore[union-attr]
            opt.zero_grad()
            (task_a + task_b).backward()
            g = torch.cat([p.grad.flatten() for p in trunk.parameters()])  # type: ignore[union-attr]
            shares.append(float(g_a.norm() / g.norm()))
            opt.step()
    report = w.report()
    assert not report.by_check(ID), [f.line() for f in report.findings]


def test_a_monitor_under_lightning_manual_optimization_is_silent(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import ManualRegressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class Monitored(ManualRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss, retain_graph=True)
            norm = torch.stack([p.grad.norm() for p in self.parameters()]).norm()  # type: ignore[union-attr]
            self.log("grad_norm", norm)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(Monitored(), loader())
    assert cb.report is not None
    assert not cb.report.by_check(ID), [f.line() for f in cb.report.findings]
    assert fired(cb.report, "error") == set()


def test_zero_grad_inside_accumulation_still_fires() -> None:
    torch.manual_seed(0)
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(8)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(0, 8, 4):
            for x, y in data[k : k + 4]:
                opt.zero_grad()  # the bug: inside the accumulation loop
                (nn.functional.mse_loss(model(x), y) / 4).backward()
            opt.step()
    (f,) = w.report().by_check(ID)
    assert f.details["discarded_backward_passes"] == 3
