"""``normalised_over_batch``: a softmax in the model's forward across the batch dimension.

Bug forms, as practitioners report them: a REINFORCE/actor-critic policy ending in
``nn.Softmax(dim=0)`` trained on a batch of states, attention pooling ``softmax(scores,
dim=0)`` over a ``(B, T)`` score, and ``F.log_softmax(x)`` without ``dim`` on a 3-D sequence
tagger's output (PyTorch picks dim 0). Clean: ``Softmax(dim=1)`` over actions, InfoNCE's
samples x samples logits (in the loss code, and inside a MoCo-style model's forward), a
train-mode BatchNorm, a time-major ``(T, B)`` attention over time.
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

ID = "normalised_over_batch"
B = 16


class Policy(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        self.softmax = nn.Softmax(dim=dim)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.net(s))


class AttnPool(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.score = nn.Linear(16, 1)
        self.out = nn.Linear(16, 3)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        h = torch.tanh(self.enc(x))
        w = torch.softmax(self.score(h).squeeze(-1), dim=self.dim)  # (B, T)
        return self.out((w.unsqueeze(-1) * h).sum(1))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return F.log_softmax(self.out(h))  # type: ignore[call-arg]  # implicit dim: 0 on 3-D


class Encoder(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32) if norm else nn.Identity(), nn.ReLU()
        )
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(self.net(x)), dim=-1)


class MoCoLike(nn.Module):
    """Computes its InfoNCE inside forward, over both axes of the samples x samples matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z1, z2 = self.enc(x), self.enc(x + 0.1 * torch.randn_like(x))
        sim = z1 @ z2.t() / 0.1
        diag = torch.arange(x.shape[0])
        return -(F.log_softmax(sim, 0)[diag, diag] + F.log_softmax(sim, 1)[diag, diag]).mean()


def _run(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    shape: tuple[int, ...] = (B, 8),
) -> Any:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config=CFG) as w, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Implicit dimension choice")
        for k in range(4):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
            opt.zero_grad()
            loss_fn(model, x).backward()
            opt.step()
    return w.report()


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def _reinforce(m: nn.Module, s: torch.Tensor) -> torch.Tensor:
    probs = m(s)
    actions = torch.arange(s.shape[0]).remainder(4).unsqueeze(1)
    returns = torch.linspace(-1, 1, s.shape[0])
    return -(torch.log(probs.gather(1, actions).squeeze(1)) * returns).mean()


def test_policy_softmax_over_the_batch_names_the_module() -> None:
    (f,) = _found(_run(Policy(dim=0), _reinforce))
    assert f.severity == "error" and f.module == "softmax"
    assert f.details["shape"] == [B, 4] and f.details["batch"] == B


def test_attention_pooling_over_the_batch() -> None:
    model = AttnPool(dim=0)
    (f,) = _found(_run(model, lambda m, x: m(x).pow(2).mean(), shape=(B, 6, 8)))
    assert f.module == "AttnPool" and f.details["op"] == "softmax"


def test_implicit_log_softmax_dim_on_a_sequence_output() -> None:
    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tags = torch.arange(B * 6).remainder(5)
        return F.nll_loss(m(x).reshape(-1, 5), tags)

    (f,) = _found(_run(Tagger(), loss, shape=(B, 6, 8)))
    assert f.details["op"] == "log_softmax" and f.details["shape"] == [B, 6, 5]


def _info_nce(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    z1, z2 = m(x), m(x + 0.1 * torch.randn_like(x))
    logits = z1 @ z2.t() / 0.07
    labels = torch.arange(x.shape[0])
    return F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)


@pytest.mark.parametrize(
    "model,loss,shape",
    [
        pytest.param(Policy(dim=1), _reinforce, (B, 8), id="softmax_over_actions"),
        pytest.param(Encoder(), _info_nce, (B, 8), id="info_nce_in_the_loss"),
        pytest.param(Encoder(norm=True), lambda m, x: m(x).pow(2).mean(), (B, 8), id="batchnorm"),
        pytest.param(MoCoLike(), lambda m, x: m(x), (B, 8), id="info_nce_inside_forward"),
        pytest.param(AttnPool(dim=1), lambda m, x: m(x).pow(2).mean(), (B, 6, 8), id="over_time"),
    ],
)
def test_look_alikes_are_silent(model: nn.Module, loss: Any, shape: tuple[int, ...]) -> None:
    assert not _found(_run(model, loss, shape=shape))


class TimeMajorAttention(nn.Module):
    """A seq2seq encoder in PyTorch's default layout (T, B, D): attention over time is dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16)  # batch_first=False
        self.score = nn.Linear(16, 1)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, B, 8)
        h, _ = self.rnn(x)
        w = torch.softmax(self.score(h).squeeze(-1), dim=0)  # over time: right here
        return self.out((w.unsqueeze(-1) * h).sum(0))


def test_time_major_attention_over_time_is_not_judged_and_says_so() -> None:
    model = TimeMajorAttention()
    report = _run(model, lambda m, x: m(x).pow(2).mean(), shape=(B, 4, 8))
    assert not _found(report) and not report.failed
    (blind,) = [f for f in report.by_check("not_observed") if f.details["reason"] == "time_major"]
    assert blind.severity == "info" and blind.details["check"] == "normalised_over_batch"


def test_a_time_major_model_without_a_softmax_over_dim_0_says_nothing() -> None:
    """The note is for a softmax it could not judge, not for every recurrent model."""
    model = TimeMajorAttention()
    model.forward = lambda x: model.out(model.rnn(x)[0].mean(0))  # type: ignore[method-assign]
    report = _run(model, lambda m, x: m(x).pow(2).mean(), shape=(B, 4, 8))
    assert not [f for f in report.findings if f.details.get("reason") == "time_major"]


def test_unbatched_policy_is_silent() -> None:
    """One state at a time: ``Softmax(dim=0)`` over a 1-D action vector is right."""

    def one(m: nn.Module, s: torch.Tensor) -> torch.Tensor:
        return -torch.log(m(s[0])[1])

    assert not _found(_run(Policy(dim=0), one))
