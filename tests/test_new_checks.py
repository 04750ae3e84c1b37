"""The newer checks on real loops: each fires on real forms of its bug, silent on look-alikes.

loss_disconnected, double_update, unregistered_param, clipped_while_scaled, and where a
NaN was born (nonfinite_grad's phase).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _loops import batches, fired, mlp
from torch import nn

import gradwatch

CFG = {"every_n_steps": 1, "on_internal_error": "raise"}


def _run(model: nn.Module, opts, body, steps: int = 4, scaler=None, **cfg):  # type: ignore[no-untyped-def]
    with gradwatch.watch(model, opts, config={**CFG, **cfg}, scaler=scaler) as w:
        for k, (x, y) in enumerate(batches(steps)):
            body(k, x, y)
    return w.report()


def _errors(report: gradwatch.Report) -> set[str]:
    return fired(report, "error")


# -- loss_disconnected -----------------------------------------------------------------------


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
    # Nothing reached gradwatch's hooks, so nothing was checked: said, not passed.
    assert [(f.check, f.details.get("reason")) for f in report.findings] == [
        ("not_observed", "no_backward")
    ]


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


# -- double_update ---------------------------------------------------------------------------


def test_shared_encoder_in_two_optimizers_is_double_update() -> None:
    enc = nn.Linear(8, 8)
    actor, critic = nn.Linear(8, 2), nn.Linear(8, 1)
    model = nn.ModuleDict({"enc": enc, "actor": actor, "critic": critic})
    opt_actor = torch.optim.Adam([*enc.parameters(), *actor.parameters()], lr=1e-3)
    opt_critic = torch.optim.SGD([*enc.parameters(), *critic.parameters()], lr=1e-2)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt_actor.zero_grad()
        opt_critic.zero_grad()
        h = enc(x)
        (actor(h).pow(2).mean() + nn.functional.mse_loss(critic(h), y)).backward()
        opt_actor.step()
        opt_critic.step()  # enc's gradient is applied a second time

    report = _run(model, [opt_actor, opt_critic], body)
    (f,) = report.by_check("double_update")
    assert f.severity == "error" and set(f.params) == {"enc.weight", "enc.bias"}
    assert f.details["optimizers"] == [{"index": 0, "class": "Adam"}, {"index": 1, "class": "SGD"}]
    assert f.count == 4


def test_step_called_twice_for_one_backward() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def helper_step() -> None:  # a helper that steps...
        opt.step()

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        helper_step()
        opt.step()  # ...plus the caller's own step

    report = _run(model, opt, body)
    (f,) = report.by_check("double_update")
    assert set(f.params) == {n for n, _ in model.named_parameters()}
    assert f.details["optimizers"] == [{"index": 0, "class": "SGD"}]
    assert "twice" in f.hint
    assert "loss_disconnected" not in fired(report, "info")


def test_two_optimizers_over_disjoint_params_and_gan_are_fine() -> None:
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"G": G, "D": D})
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        z = torch.randn(16, 4)
        D.zero_grad()
        fake = G(z)
        (bce(D(x), torch.ones(16, 1)) + bce(D(fake.detach()), torch.zeros(16, 1))).backward()
        opt_d.step()
        G.zero_grad()
        bce(D(fake), torch.ones(16, 1)).backward()
        opt_g.step()

    report = _run(gan, [opt_d, opt_g], body)
    assert _errors(report) == set(), [f.line() for f in report.findings]


def test_zeroed_gradient_stepped_again_is_not_double() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()  # zero gradients: nothing applied twice

    report = _run(model, opt, body)
    assert "double_update" not in fired(report, "info")


# -- unregistered_param ----------------------------------------------------------------------


class ListBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = [nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8))]  # the bug
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class DictHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = {"a": nn.Linear(8, 1), "b": nn.Linear(8, 1)}  # the bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.heads["a"](h) + self.heads["b"](h)


def _plain_loop(model: nn.Module, steps: int = 3) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return _run(model, opt, body, steps=steps)


def test_layers_in_a_plain_list_are_unregistered() -> None:
    report = _plain_loop(ListBlocks())
    found = report.by_check("unregistered_param")
    params = {p for f in found for p in f.params}
    assert params == {
        "blocks[0].weight",
        "blocks[0].bias",
        "blocks[1].1.weight",
        "blocks[1].1.bias",
    }
    assert {f.module for f in found} == {"blocks[0]", "blocks[1].1"}
    assert all(f.severity == "error" and "nn.ModuleList" in f.hint for f in found)
    assert all(f.count == 1 for f in found)


def test_heads_in_a_plain_dict_are_unregistered() -> None:
    report = _plain_loop(DictHeads())
    params = {p for f in report.by_check("unregistered_param") for p in f.params}
    assert params == {
        "heads['a'].weight",
        "heads['a'].bias",
        "heads['b'].weight",
        "heads['b'].bias",
    }


def test_hidden_frozen_or_no_grad_modules_are_not_unregistered() -> None:
    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Linear(8, 1)
            teacher = nn.Linear(8, 1)
            self._teacher = [teacher]  # hidden on purpose: not saved, not trained
            self.frozen_proj = (nn.Linear(8, 8).requires_grad_(False),)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                soft = self._teacher[0](x)
            return self.student(self.frozen_proj[0](x)) + 0 * soft

    report = _plain_loop(Distill())
    assert _errors(report) == set(), [f.line() for f in report.findings]


def test_scan_stops_after_scan_steps() -> None:
    model = ListBlocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(
        model, opt, config={"checks": {"unregistered_param": {"scan_steps": 1}}}
    ) as w:
        for k, (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if k == 0:
                assert w._pipe.scout._global is None
        assert not w._pipe.scout.scanning
    assert w.report().by_check("unregistered_param")
    hooks = nn.modules.module._global_forward_hooks
    assert not hooks, "the global hook must be gone"


# -- clipped_while_scaled --------------------------------------------------------------------


def _amp_loop(order: str, steps: int = 4, inf_at: int = -1) -> gradwatch.Report:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if k == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if order == "clip_then_unscale":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(opt)
        elif order == "clip_then_step":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif order == "noise_then_step":
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p.grad) * 1e-3)
        elif order == "unscale_then_clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return _run(model, opt, body, steps=steps, scaler=scaler)


@pytest.mark.parametrize("order", ["clip_then_unscale", "clip_then_step", "noise_then_step"])
def test_gradients_edited_while_scaled(order: str) -> None:
    report = _amp_loop(order)
    (f,) = report.by_check("clipped_while_scaled")
    assert f.severity == "error" and f.count == 4
    assert len(f.params) == 4 and "unscale_" in f.hint


@pytest.mark.parametrize("order", ["unscale_then_clip", "plain"])
def test_unscale_then_clip_and_plain_amp_are_fine(order: str) -> None:
    report = _amp_loop(order)
    assert _errors(report) == set(), [f.line() for f in report.findings]
    assert "clipped_while_scaled" not in fired(report, "info")


def test_grad_scaler_skipping_inf_steps_is_fine() -> None:
    report = _amp_loop("unscale_then_clip", steps=5, inf_at=2)
    assert report.skipped_steps == 1
    assert "clipped_while_scaled" not in fired(report, "info")
    assert _errors(report) == set()


def test_scaler_method_restored_on_exit() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with gradwatch.watch(model, opt, scaler=scaler):
        assert "unscale_" in vars(scaler)
    assert "unscale_" not in vars(scaler)


# -- nonfinite_grad: where the NaN was born ---------------------------------------------------


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
