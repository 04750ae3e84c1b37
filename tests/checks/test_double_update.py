"""``double_update``: parameters stepped twice for one backward; GANs, disjoint optimizers
and re-zeroed gradients do not fire.

Real loops: each real form of the bug fires, its look-alikes stay silent.
"""

from __future__ import annotations

import torch
from _check_loops import errors_of as _errors
from _check_loops import run_steps as _run
from _loops import fired, mlp
from torch import nn


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
