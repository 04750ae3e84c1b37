"""``sample_dependence``: three real ways samples leak into each other, and models that do not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "sample_dependence"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any = ce) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, config=CFG)


class SoftmaxOverBatch(nn.Module):
    """Attention pooling whose softmax runs over dim 0, the batch, not the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(4, 1), nn.Linear(4, 10)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, positions, features)
        w = torch.softmax(self.score(x), dim=0)
        return self.head((w * x).sum(1))


class ViewMixesSamples(nn.Module):
    """``view(seq, batch, d)`` on a ``(batch, seq, d)`` tensor instead of ``transpose``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 8), nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        out, _ = self.rnn(x.view(s, b, d))  # GRU wants (seq, batch, d)
        return self.head(out[-1])


class BatchStatistics(nn.Module):
    """A hand-written normaliser over the batch, outside any BatchNorm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = (h - h.mean(0)) / (h.std(0) + 1e-5)
        return self.b(torch.relu(h))


def _seq_batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 5, 4, generator=gen), torch.randint(0, 10, (8,), generator=gen)


@pytest.mark.parametrize(
    "make, batch",
    [(SoftmaxOverBatch, _seq_batch), (ViewMixesSamples, _seq_batch), (BatchStatistics, data)],
)
def test_samples_that_leak_into_each_other_are_found(make: Any, batch: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch())
    (finding,) = findings(report, CHECK)
    assert finding.severity == "error" and report.failed
    assert finding.details["other_samples"] and finding.details["inputs"] == ["batch[0]"]
    assert verdicts(report) == {CHECK: "finding"}


def test_train_mode_batch_norm_is_info() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    report = _probe(model, data())
    (finding,) = findings(report, CHECK)
    assert finding.severity == "info" and finding.details["cause"] == "batch_norm"
    assert not report.failed


class TinyLM(nn.Module):
    """Token ids in, logits out: the dependence is read at the embedding's output."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(50, 16), nn.Embedding(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm, self.head, self.leak = nn.LayerNorm(16), nn.Linear(16, 50), leak

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        if self.leak:
            h = torch.softmax(h, dim=0) * h
        return self.head(h)


def lm_loss(m: Any, b: Any) -> Tensor:
    logits = m(b["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, 50), b["input_ids"][:, 1:].reshape(-1))


@pytest.mark.parametrize("leak", [False, True])
def test_token_models_are_read_at_their_embeddings(leak: bool) -> None:
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(0, 50, (4, 8))}
    report = _probe(TinyLM(leak), batch, lm_loss)
    found = findings(report, CHECK)
    assert bool(found) is leak
    if leak:
        assert found[0].details["inputs"] == ["output of emb"]


@pytest.mark.parametrize(
    "make",
    [
        mlp,
        lambda: nn.Sequential(
            nn.Linear(4, 16), nn.LayerNorm(16), nn.Dropout(0.3), nn.Linear(16, 10)
        ),
        lambda: nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16).eval(), nn.Linear(16, 10)),
    ],
)
def test_independent_samples_pass(make: Any) -> None:
    report = _probe(make(), data())
    assert verdicts(report) == {CHECK: "passed"} and not report.findings


def test_a_batch_of_one_is_not_judged() -> None:
    x, y = data(n=1)
    report = _probe(mlp(), (x, y))
    assert verdicts(report) == {CHECK: "not_observed"}
    assert report.findings[0].details["reason"] == "probe_one_sample"


class OneSampleReadsAnother(nn.Module):
    """Sample 9's output reads sample 3's input (a hand-written "context" row lookup)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 10)

    def forward(self, x: Tensor) -> Tensor:
        out = self.a(x)
        if x.shape[0] > 9:
            out = torch.cat([out[:9], out[9:10] + 0.5 * self.a(x[3:4]), out[10:]])
        return out


def test_a_dependence_of_one_sample_in_the_middle_of_the_batch_is_found() -> None:
    """Issue 47 item 9: the probes look at the whole batch, not its first or middle sample."""
    torch.manual_seed(0)
    report = _probe(OneSampleReadsAnother(), data(n=16))
    (finding,) = findings(report, CHECK)
    assert finding.details["sample"] == 9 and finding.details["other_samples"] == [3]
