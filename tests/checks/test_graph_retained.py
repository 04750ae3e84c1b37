"""``graph_retained_across_steps``: each step's loss graph kept alive by the training code.

Bug forms, as practitioners report them (PyTorch's FAQ "my model reports cuda runtime error
(2): out of memory" / "accumulating history across your training loop"): ``running_loss +=
loss`` for logging, ``losses.append(loss)`` to average later, a GAN loop that keeps
``history["d"].append(d_loss)``. Clean: ``running_loss += loss.item()``, ``loss.detach()``,
``prev_loss = loss`` kept for one step, gradient accumulation over micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from _check_loops import CFG
from _loops import batches, mlp

import gradwatch

ID = "graph_retained_across_steps"
Keep = Callable[[dict[str, Any], torch.Tensor], None]


def _run(keep: Keep, steps: int = 6, accumulate: int = 1) -> Any:
    model = mlp(8, 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"running": 0.0, "list": [], "prev": None}
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k, (x, y) in enumerate(batches(steps * accumulate)):
            loss = F.mse_loss(model(x), y) / accumulate
            loss.backward()
            keep(state, loss)
            if (k + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _running(s: dict[str, Any], loss: torch.Tensor) -> None:
    s["running"] += loss


def test_running_loss_plus_equals_loss() -> None:
    (f,) = _found(_run(_running))
    assert f.severity == "warning" and f.details["retained"] >= 3
    assert "test_graph_retained.py" in (f.details["backward_at"] or "")


def test_losses_appended_to_a_list() -> None:
    (f,) = _found(_run(lambda s, loss: s["list"].append(loss)))
    assert f.details["steps"][:3] == [0, 1, 2]


def test_gan_history_dict() -> None:
    netG, netD = mlp(4, 16, 8), mlp(8, 16, 1)
    opt_g = torch.optim.Adam(netG.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(netD.parameters(), lr=1e-3)
    history: dict[str, list[torch.Tensor]] = {"d": [], "g": []}
    with gradwatch.watch({"G": netG, "D": netD}, {"G": opt_g, "D": opt_d}, config=CFG) as w:
        for _ in range(6):
            real, z = torch.randn(16, 8), torch.randn(16, 4)
            opt_d.zero_grad()
            d_loss = F.softplus(-netD(real)).mean() + F.softplus(netD(netG(z).detach())).mean()
            d_loss.backward()
            opt_d.step()
            history["d"].append(d_loss)  # keeps every step's D graph
            opt_g.zero_grad()
            g_loss = F.softplus(-netD(netG(z))).mean()
            g_loss.backward()
            opt_g.step()
            history["g"].append(g_loss.item())
    assert _found(w.report())


def test_item_detach_and_one_kept_step_are_silent() -> None:
    def item(s: dict[str, Any], loss: torch.Tensor) -> None:
        s["running"] += loss.item()
        s["list"].append(loss.detach())
        s["prev"] = loss  # one step kept for a comparison: constant, not growing

    assert not _found(_run(item))


def test_gradient_accumulation_is_silent() -> None:
    def acc(s: dict[str, Any], loss: torch.Tensor) -> None:
        s["running"] += loss.item()

    assert not _found(_run(acc, accumulate=4))


def test_accumulation_and_retention_together() -> None:
    assert _found(_run(_running, accumulate=2))
