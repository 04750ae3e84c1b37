"""``double_backward``: the same loss graph backpropagated more than once into one step.

Bug forms: a helper that calls ``backward(retain_graph=True)`` and a loop that calls it
again, a logging backward without ``zero_grad()`` before the training one, three passes of
one loss, and under Lightning (manual optimization) two ``manual_backward`` of one loss;
Lightning's automatic optimization zeroes between ``training_step`` and its own backward, so
a ``backward`` inside ``training_step`` is neither doubled nor a dropped micro-batch there (a
backward of the same forward, cleared: the step uses the loss's gradient once). Clean: two
different losses over one graph (multi-task), SAM's two passes, a gradient penalty
(``create_graph=True``), truncated BPTT, PCGrad, and a logging backward followed by
``zero_grad()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _check_loops import CFG
from _loops import batches, fired, mlp
from torch import nn

import gradwatch
from gradwatch.checks.double_backward import DoubleBackward
from gradwatch.checks.step_without_grad import StepWithoutGrad

STEPS = 5

Body = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], None]


def _run(body: Body, model: nn.Module | None = None) -> gradwatch.Report:
    model = model if model is not None else mlp(8, 16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in batches(STEPS, out=2):
            opt.zero_grad()
            body(model, opt, x, y)
            opt.step()
    return w.report()


def _helper_then_loop(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(m(x), y)
    loss.backward(retain_graph=True)  # inside a "compute_loss" helper
    loss.backward()  # and again in the loop


def _logging_backward(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(m(x), y)
    loss.backward(retain_graph=True)
    torch.stack([p.grad.norm() for p in m.parameters()])  # type: ignore[union-attr]
    loss.backward()  # no zero_grad() between


def _three_times(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(m(x), y)
    for _ in range(3):
        loss.backward(retain_graph=True)


@pytest.mark.parametrize(
    ("body", "repeats"), [(_helper_then_loop, 1), (_logging_backward, 1), (_three_times, 2)]
)
def test_a_repeated_backward_fires_once(body: Body, repeats: int) -> None:
    report = _run(body)
    (f,) = report.by_check(DoubleBackward.id)
    assert f.severity == "error" and f.first_step == 0 and f.count == STEPS
    assert f.details["repeated_backward_passes"] == repeats
    assert fired(report) == {DoubleBackward.id}, report.findings


def _multitask(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    out = m(x)
    nn.functional.mse_loss(out[:, 0], y[:, 0]).backward(retain_graph=True)
    nn.functional.l1_loss(out[:, 1], y[:, 1]).backward()


def _logging_then_zero(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.mse_loss(m(x), y)
    loss.backward(retain_graph=True)
    o.zero_grad()
    loss.backward()


def _penalty(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    out = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (nn.functional.mse_loss(out, y) + 0.1 * gx.square().sum()).backward()


def _sam(m: nn.Module, o: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.mse_loss(m(x), y).backward()
    with torch.no_grad():
        eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in m.parameters()]  # type: ignore
        for p, e in zip(m.parameters(), eps):
            p.add_(e)
    o.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()
    with torch.no_grad():
        for p, e in zip(m.parameters(), eps):
            p.sub_(e)


@pytest.mark.parametrize("body", [_multitask, _logging_then_zero, _penalty, _sam])
def test_correct_multi_pass_loops_are_clean(body: Body) -> None:
    assert not _run(body).by_check(DoubleBackward.id)


def test_truncated_bptt_is_clean() -> None:
    rnn, head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    seq = torch.randn(2, 24, 4)
    with gradwatch.watch(model, opt, config=CFG) as w:
        h = None
        for t in range(0, 24, 6):
            out, h = rnn(seq[:, t : t + 6], h)
            h = h.detach()
            opt.zero_grad()
            head(out).square().mean().backward()
            opt.step()
    assert not fired(w.report()), w.report().findings


def test_under_lightning(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _lightning_helpers import ManualRegressor, Regressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class ManualTwice(ManualRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss, retain_graph=True)  # e.g. to log gradient norms
            self.manual_backward(loss)
            opt.step()

    class BackwardInStep(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            loss.backward(retain_graph=True)  # Lightning zeroes, then backpropagates again
            return loss

    def fit(module: Any, root: Path) -> gradwatch.Report:
        cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
        trainer(root, cb).fit(module, loader())
        assert cb.report is not None
        return cb.report

    twice = fit(ManualTwice(), tmp_path / "manual")
    assert fired(twice, "error") == {DoubleBackward.id}, twice.findings
    # Automatic optimization zeroes the gradients between training_step and its own
    # backward: the user's backward was cleared, not doubled; both passes were of the same
    # forward, so no micro-batch was lost either (issue 43: a gradient monitor does the same).
    cleared = fit(BackwardInStep(), tmp_path / "auto")
    assert fired(cleared, "error") == set(), cleared.findings
    assert not cleared.by_check(StepWithoutGrad.id)
