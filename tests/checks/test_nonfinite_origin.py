"""``nonfinite_grad``: where a NaN or inf was born (forward, backward, the loss, the update).

Real loops: each real form of the bug fires, its look-alikes stay silent.
"""

from __future__ import annotations

import torch
from _check_loops import CFG
from _check_loops import run_steps as _run
from _loops import batches, mlp
from torch import nn

import gradwatch


class Normalise(nn.Module):
    """x / ||x||: NaN for an all-zero row (no eps)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


def _nan_loop(model: nn.Module, make_x, steps: int = 3, **cfg) -> gradwatch.Report:  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(make_x(k, x)), y).backward()
        opt.step()

    return _run(model, opt, body, steps=steps, **cfg)


def test_nan_born_in_a_normaliser_is_traced_to_it() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Normalise(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU output is 0: the norm is 0

    report = _nan_loop(model, lambda k, x: x)
    (f,) = report.by_check("nonfinite_grad")
    assert f.details["phase"] == "forward" and f.details["origin_module"] == "2"
    assert f.module == "2" and "'2'" in f.message and "eps" in f.hint


def test_nan_born_in_forward_after_the_first_steps_is_traced_when_it_recurs() -> None:
    """Late NaN (hooks trimmed): armed by the first one, traced at the next (skipped step)."""
    model = nn.Sequential(nn.Linear(8, 8), Normalise(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={**CFG, "trim_hooks_after": 2}) as w:
        for k, (x, y) in enumerate(batches(8)):
            opt.zero_grad()
            if k >= 4:
                with torch.no_grad():
                    x = x * 0
                model[0].bias.data.zero_()  # an all-zero row reaches the normaliser
            nn.functional.mse_loss(model(x), y).backward()
            grads_ok = all(torch.isfinite(p.grad).all() for p in model.parameters())
            saved = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if not grads_ok:  # a loop that rolls back non-finite updates keeps weights finite
                with torch.no_grad():
                    for p, s in zip(model.parameters(), saved):
                        p.copy_(s)
    (f,) = w.report().by_check("nonfinite_grad")
    assert f.first_step == 4 and f.count == 4
    assert f.details["phase"] == "forward" and f.details["origin_module"] == "1"


class Block(nn.Module):
    """A container with no weights of its own: its child's weights decide its output."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


def test_nan_weights_inside_a_block_are_not_the_blocks_forward() -> None:
    """The block's inputs are finite and its output is not, but its child's weights were
    NaN already: nothing in the forward made the NaN (no phase, weights_nonfinite)."""
    model = nn.Sequential(Block(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].inner.weight[0, 0] = float("nan")  # e.g. loaded from a broken checkpoint

    (f,) = _nan_loop(model, lambda k, x: x).by_check("nonfinite_grad")
    assert f.details["phase"] is None and f.details["weights_nonfinite"] is True
    assert "update_step" not in f.details  # no finite step came before it
    assert "forward pass of" not in f.message


def test_an_update_that_overflows_fp16_weights_is_named() -> None:
    """Pure fp16 weights with Adam: eps=1e-8 rounds to 0, step 0's update divides by zero.
    Its gradients were finite; the NaN appears in the next step's forward, from the weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(x.half()).float()
        nn.functional.mse_loss(out, torch.zeros_like(out)).backward()
        opt.step()

    (f,) = _run(model, opt, body, steps=3).by_check("nonfinite_grad")
    assert f.first_step == 1 and f.details["update_step"] == 0
    assert f.details["phase"] is None and f.details["weights_nonfinite"] is True
    assert "update made them" in f.message and "eps" in f.hint and "float32" in f.hint


def test_log_zero_in_a_hand_written_loss_is_the_loss() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # a class no sample may take
        p = torch.softmax(model(x), -1) * mask  # a probability of exactly 0
        (-(p.log()).mean()).backward()  # log(0) = -inf; its gradient inf * 0 = NaN
        opt.step()

    (f,) = _run(model, opt, body, steps=2).by_check("nonfinite_grad")
    assert f.details["phase"] == "loss" and f.details["origin_module"] == "(loss)"


def test_nan_born_in_backward_keeps_its_backward_origin() -> None:
    class GatedSqrt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.middle = nn.Linear(4, 4)
            self.last = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.middle(self.first(x))
            gated = torch.where(h > 100.0, torch.sqrt(h - 100.0), torch.zeros_like(h))
            return self.last(h + gated)  # finite forward; sqrt at <0 back-propagates NaN

    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[:, :4]), y).backward()
        opt.step()

    (f,) = _run(model, opt, body, steps=2).by_check("nonfinite_grad")
    assert f.details["phase"] == "backward"
    assert f.module == "middle" and f.details["origin"] in {"middle.weight", "middle.bias"}


def test_probe_is_disarmed_after_the_first_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"trim_hooks_after": 2}) as w:
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert not w._pipe.scout.armed and not w._pipe.scout._probe


def test_fp16_overflow_in_forward_under_a_grad_scaler_names_the_module() -> None:
    """Every step skipped by the scaler: the info finding says which module overflows."""

    class Overflow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 1e3).half().exp().float()  # fp16 exp overflows to inf

    model = nn.Sequential(nn.Linear(8, 8), Overflow(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    report = _run(model, opt, body, steps=4, scaler=scaler)
    (f,) = report.by_check("nonfinite_grad")
    assert f.severity == "info" and report.skipped_steps >= 3
    assert f.details["phase"] == "forward" and f.details["origin_module"] == "1"
