"""``sample_dependence`` and ``batch_order_dependent`` on time-major models (pytorch/examples
word_language_model, the nn.Transformer LM tutorial): ``(seq, batch)`` tensors through
``batch_first=False`` layers whose batch axis runs to the output's dim 1. The leading dim is
time, so they are not judged (said so); the bug forms stay caught: a ``batch_first=False``
LSTM fed ``(batch, seq, d)`` and read as ``out[:, -1]``, a softmax over dim 0 in a
batch-first model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

V = 20


class WordLM(nn.Module):
    """word_language_model's RNNModel: embedding, LSTM (batch_first=False), tied decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(V, 16), nn.LSTM(16, 16, 2)
        self.decoder = nn.Linear(16, V)
        self.decoder.weight = self.encoder.weight

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.encoder(x))
        return self.decoder(out)


class TransformerLM(nn.Module):
    """The nn.Transformer LM tutorial: (seq, batch) tokens, a square subsequent mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1)  # batch_first=False
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.linear = nn.Linear(16, V)

    def forward(self, src: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(0))
        return self.linear(self.encoder(self.embedding(src), mask))


def time_major_tokens() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, V, (4, 11), generator=gen).t().contiguous()  # batchify: (seq, batch)
    return data[:-1], data[1:]


def lm_loss(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]).view(-1, V), b[1].reshape(-1))


@pytest.mark.parametrize("check", ["sample_dependence", "batch_order_dependent"])
@pytest.mark.parametrize("make", [WordLM, TransformerLM])
def test_a_time_major_language_model_is_not_judged_and_says_why(make: Any, check: str) -> None:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    report = gradwatch.probe(model, time_major_tokens(), lm_loss, opt, config=only(check))
    assert not [f for f in report.findings if f.severity in ("warning", "error")]
    assert verdicts(report) == {check: "not_observed"}
    (record,) = report.probes
    assert record.details["reason"] == "time_major" and "batch_first=False" in record.note


class LstmFedBatchFirst(nn.Module):
    """The bug: nn.LSTM (batch_first=False) fed (batch, seq, d), the last "step" read."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 8), nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def batch_first_seqs() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(8, 5, 4, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def seq_ce(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("check", ["sample_dependence", "batch_order_dependent"])
def test_an_lstm_fed_batch_first_without_batch_first_is_still_an_error(check: str) -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(LstmFedBatchFirst(), batch_first_seqs(), seq_ce, config=only(check))
    (found,) = findings(report, check)
    assert found.severity == "error"


class SoftmaxOverBatch(nn.Module):
    """A batch-first GRU classifier whose softmax runs over dim 0 (the batch) by mistake."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return torch.log_softmax(self.head(out[:, -1]), dim=0)


def test_a_softmax_over_the_batch_in_a_batch_first_model_is_still_an_error() -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(
        SoftmaxOverBatch(),
        batch_first_seqs(),
        lambda m, b: F.nll_loss(m(b[0]), b[1]),
        config=only("sample_dependence"),
    )
    (found,) = findings(report, "sample_dependence")
    assert found.severity == "error"
