"""``unregistered_param`` (loose leaves) on correct scripts that hold ``requires_grad``
tensors outside any module on purpose (issue 50).

Correct: a CLIP-style learnable log-scale (``torch.zeros(1, requires_grad=True)``) in the
watched optimizer; a temperature in its own optimizer that steps every few iterations; a
scale updated by hand through ``.data`` (the old tutorials' manual SGD: no version bump); a
PINN's collocation points, created once with ``requires_grad`` and fed to the model every
step to differentiate against. Bug forms still caught: the loss head outside the model, in
no optimizer; an input patch put in an optimizer whose ``step()`` is never called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch

ID = "unregistered_param"
STEPS = 10  # past the scan (8 steps): a leaf an optimizer holds is judged when it ends


def _found(w: Any) -> list[Any]:
    return [f for f in w.report().findings if f.check == ID]


def _xy(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_clip_log_scale_in_the_watched_optimizer_is_silent() -> None:
    torch.manual_seed(0)
    towers = nn.ModuleDict({"img": nn.Linear(16, 8), "txt": nn.Linear(12, 8)})
    log_scale = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([*towers.parameters(), log_scale], lr=1e-3)
    with gradwatch.watch(towers, opt, config=CFG) as w:
        for k in range(STEPS):
            x, _ = _xy(k)
            a = F.normalize(towers["img"](x), dim=-1)
            b = F.normalize(towers["txt"](x[:, :12] + 0.1), dim=-1)
            logits = a @ b.T * log_scale.exp()
            target = torch.arange(8)
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not _found(w)


def test_temperature_in_its_own_optimizer_stepping_every_few_iterations_is_silent() -> None:
    torch.manual_seed(0)
    net = nn.Linear(16, 4)
    temperature = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_t = torch.optim.Adam([temperature], lr=1e-2)
    with gradwatch.watch(net, opt, config=CFG) as w:
        for k in range(STEPS + 2):
            x, y = _xy(k)
            opt.zero_grad()
            F.cross_entropy(net(x) / temperature, y).backward()
            opt.step()
            if k % 4 == 3:  # calibrated every fourth batch
                opt_t.step()
                opt_t.zero_grad()
    assert not _found(w)


def test_scale_updated_by_hand_through_data_is_silent() -> None:
    torch.manual_seed(0)
    net = nn.Linear(16, 4)
    scale = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gradwatch.watch(net, opt, config=CFG) as w:
        for k in range(STEPS):
            x, y = _xy(k)
            opt.zero_grad()
            F.cross_entropy(net(x) * scale, y).backward()
            opt.step()
            scale.data -= 0.01 * scale.grad.data  # no version bump, yet it moves
            scale.grad.zero_()
    assert not _found(w)


def test_pinn_collocation_points_fed_every_step_are_silent() -> None:
    """Raissi et al.: u' = cos(x) on [0, 1], u(0) = 0; the points require grad for du/dx."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.linspace(0, 1, 64).unsqueeze(1).requires_grad_(True)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with gradwatch.watch(net, opt, config=CFG) as w:
        for _ in range(STEPS):
            u = net(x)
            (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
            residual = (du - torch.cos(x)).pow(2).mean()
            opt.zero_grad()
            (residual + net(torch.zeros(1, 1)).pow(2).mean()).backward()
            opt.step()
    assert not _found(w)


def test_loss_head_outside_the_model_still_fires() -> None:
    torch.manual_seed(0)
    net, head = nn.Linear(16, 8), nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gradwatch.watch(net, opt, config=CFG) as w:
        for k in range(STEPS):
            x, y = _xy(k)
            opt.zero_grad()
            F.cross_entropy(head(net(x)), y).backward()
            opt.step()
    (f,) = _found(w)
    assert f.severity == "error" and f.details["parameter"]


def test_patch_in_an_optimizer_that_never_steps_still_fires() -> None:
    """An adversarial patch trained with the model: its optimizer's step() forgotten."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    patch = torch.zeros(1, 16, requires_grad=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_patch = torch.optim.Adam([patch], lr=1e-2)
    with gradwatch.watch(net, opt, config=CFG) as w:
        for k in range(STEPS):
            x, y = _xy(k)
            opt.zero_grad()
            opt_patch.zero_grad()
            F.cross_entropy(net(x + patch), y).backward()
            opt.step()  # opt_patch.step() is missing
    (f,) = _found(w)
    assert f.severity == "error" and f.details["shapes"] == [[1, 16]] and f.details["held"]
