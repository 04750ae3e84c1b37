"""``loss_broadcast``: ``(N,1)`` against ``(N,)`` broadcast to ``(N,N)`` inside the loss.

Bug forms, as practitioners report them: a regression head ``nn.Linear(d, 1)`` into
``mse_loss`` against a ``(N,)`` target (PyTorch's "target size different to the input size"
warning), an actor-critic value loss ``(values - returns).pow(2).mean()`` with a ``(N,1)``
critic, and a DQN's ``q.gather(1, a)`` against a ``(N,)`` TD target in ``smooth_l1_loss``.
Clean: matching shapes, K ensemble heads ``(K,N)`` against one ``(N,)`` target, pairwise
distances between two outputs of the model (a triplet/contrastive loss), per-sample weights.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch
from gradwatch.checks.loss_broadcast import stretched

ID = "loss_broadcast"
N = 16
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Regressor(nn.Module):
    def __init__(self, out: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _run(model: nn.Module, loss_fn: Loss) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config=CFG) as w, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using a target size")
        for k in range(4):
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(N, 8, generator=g), torch.randn(N, generator=g)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def test_shape_rule() -> None:
    assert stretched((N, 1), (N, N)) == (1, 0)
    assert stretched((N,), (N, N)) == (0, 1)
    assert stretched((4, N), (4, N)) is None  # ensemble heads: only the target stretched
    assert stretched((N, 1), (N, 32)) is None  # a gate against features of another size
    assert stretched((), ()) is None


def test_regression_head_mse_against_flat_target() -> None:
    (f,) = _found(_run(Regressor(), lambda m, x, y: F.mse_loss(m(x), y)))
    assert f.severity == "error" and f.module == "head"
    assert f.details["op"] == "mse_loss"
    assert f.details["prediction_shape"] == [N, 1] and f.details["broadcast_shape"] == [N, N]


def test_actor_critic_value_loss() -> None:
    def loss(m: nn.Module, x: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        values = m(x)  # (N, 1)
        advantages = returns - values.detach().squeeze(-1)
        return (values - returns).pow(2).mean() + 0.0 * advantages.mean()

    (f,) = _found(_run(Regressor(), loss))
    assert f.details["op"] == "sub" and f.module == "head"


def test_dqn_gathered_q_against_td_target() -> None:
    def loss(m: nn.Module, x: torch.Tensor, td: torch.Tensor) -> torch.Tensor:
        q = m(x)  # (N, 4)
        actions = torch.arange(N).remainder(4).unsqueeze(1)
        return F.smooth_l1_loss(q.gather(1, actions), td)

    (f,) = _found(_run(Regressor(out=4), loss))
    assert f.details["op"] == "smooth_l1_loss"


@pytest.mark.parametrize(
    "model,loss",
    [
        pytest.param(Regressor(), lambda m, x, y: F.mse_loss(m(x).squeeze(-1), y), id="squeezed"),
        pytest.param(
            Regressor(out=4),
            lambda m, x, y: F.mse_loss(m(x).t(), y.expand(4, N)),
            id="ensemble_expanded_target",
        ),
        pytest.param(
            Regressor(out=4),
            lambda m, x, y: (m(x).t() - y).pow(2).mean(),
            id="ensemble_heads_KxN_vs_N",
        ),
        pytest.param(
            Regressor(out=3),
            lambda m, x, y: (
                torch.cdist(m(x), m(x)).mean() + (m(x)[:, None] - m(x)[None]).abs().mean()
            ),
            id="pairwise_distances",
        ),
        pytest.param(
            Regressor(),
            lambda m, x, y: ((m(x).squeeze(-1) - y) ** 2 * torch.linspace(0, 1, N)).mean(),
            id="per_sample_weights",
        ),
    ],
)
def test_look_alikes_are_silent(model: nn.Module, loss: Loss) -> None:
    assert not _found(_run(model, loss))
