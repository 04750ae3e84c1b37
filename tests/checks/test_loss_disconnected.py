"""``loss_disconnected``: a loss cut off from the model fires; detach, no_grad teachers and
hand-written gradients do not.

Real loops: each real form of the bug fires, its look-alikes stay silent.
"""

from __future__ import annotations

import copy

import torch
from _check_loops import CFG
from _check_loops import errors_of as _errors
from _check_loops import run_steps as _run
from _loops import batches, fired, mlp
from torch import nn

import gradwatch


def test_loss_rebuilt_from_item_is_disconnected() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        value = nn.functional.mse_loss(model(x), y).item()
        torch.tensor(value, requires_grad=True).backward()  # the graph is cut here
        opt.step()

    report = _run(model, opt, body)
    (f,) = report.by_check("loss_disconnected")
    assert f.severity == "error" and f.details["cause"] == "disconnected"
    assert set(f.params) == {n for n, _ in model.named_parameters()}
    assert f.count == 4 and ".item()" in f.hint
    assert "ghost_param" not in fired(report, "info")


def test_loss_from_a_no_grad_metric_helper_is_no_grad() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    @torch.no_grad()
    def val_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = val_loss(x, y).requires_grad_()  # reused for training: no graph to the model
        loss.backward()
        opt.step()

    (f,) = _run(model, opt, body).by_check("loss_disconnected")
    assert f.details["cause"] == "no_grad" and "no_grad" in f.hint


def test_detached_output_is_disconnected() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target_scale = nn.Parameter(torch.ones(()))  # something else does require grad

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        (nn.functional.mse_loss(model(x).detach(), y) * target_scale).backward()
        opt.step()

    (f,) = _run(model, opt, body).by_check("loss_disconnected")
    assert f.details["cause"] == "disconnected"


def test_ema_teacher_under_no_grad_and_averaged_model_are_fine() -> None:
    student = mlp()
    teacher = copy.deepcopy(student).requires_grad_(False)
    swa = torch.optim.swa_utils.AveragedModel(student)
    opt = torch.optim.SGD(student.parameters(), lr=0.05)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        with torch.no_grad():
            soft = teacher(x)
        loss = nn.functional.mse_loss(student(x), 0.5 * y + 0.5 * soft)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.mul_(0.9).add_(ps, alpha=0.1)
        swa.update_parameters(student)
        with torch.no_grad():
            student(x)  # an evaluation forward after the step, before the next window

    report = _run(student, opt, body, steps=5)
    assert fired(report) == set(), [f.line() for f in report.findings]


def test_truncated_bptt_detach_is_fine() -> None:
    rnn = nn.RNN(4, 8, batch_first=True)
    head = nn.Linear(8, 1)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seq = torch.randn(2, 12, 4)
    with gradwatch.watch(model, opt, config=CFG) as w:
        h = None
        for t in range(0, 12, 3):
            opt.zero_grad()
            out, h = rnn(seq[:, t : t + 3], h)
            h = h.detach()  # truncated BPTT: the hidden state is cut, the loss is not
            head(out).pow(2).mean().backward()
            opt.step()
    report = w.report()
    assert fired(report) == set(), [f.line() for f in report.findings]


def test_optimizer_switch_between_phases_is_fine() -> None:
    enc, head = mlp(8, 16, 8), nn.Linear(8, 1)
    model = nn.Sequential(enc, head)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.05)  # phase 1: everything
    opt_b = torch.optim.Adam(head.parameters(), lr=1e-3)  # phase 2: the head only (shared)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt = opt_a if k < 3 else opt_b
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    report = _run(model, [opt_a, opt_b], body, steps=6)
    assert _errors(report) == set(), [f.line() for f in report.findings]


def test_no_step_without_forward_is_not_disconnected() -> None:
    """A step with neither forward nor backward (an idle optimizer) is not a cut-off loss."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        if k % 2 == 0:
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    report = _run(model, opt, body)
    assert "loss_disconnected" not in fired(report, "info")


def test_gradients_assigned_by_hand_are_not_disconnected() -> None:
    """Gradient surgery / autograd.grad loops write .grad without any accumulation hook."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        for p, g in zip(params, grads):
            p.grad = g.clamp(-1.0, 1.0)
        opt.step()

    report = _run(model, opt, body)
    assert "loss_disconnected" not in fired(report, "info")
    # The gradients written by hand are the step's gradients: judged, and clean.
    assert report.findings == [], report.findings


def test_without_optimizer_a_cut_off_loss_fails_as_not_observed() -> None:
    model = mlp()
    with gradwatch.watch(model, config=CFG) as w:
        for x, y in batches(3):
            value = nn.functional.mse_loss(model(x), y).item()
            torch.tensor(value, requires_grad=True).backward()
    report = w.report()
    assert report.failed
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "no_step"
