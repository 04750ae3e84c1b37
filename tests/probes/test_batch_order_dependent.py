"""``batch_order_dependent``: three ways a sample's result depends on its place in the batch
(from practitioners' reports), and the correct designs that resemble them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import gradwatch
from gradwatch.probes.order import derangement

CHECK = "batch_order_dependent"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any = ce) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, config=CFG)


class PositionalEncoding(nn.Module):
    """The PyTorch tutorial's encoding, written for ``(seq, batch, d)``: ``pe[: x.size(0)]``."""

    def __init__(self, d: int, length: int = 64) -> None:
        super().__init__()
        pos = torch.arange(length).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(length, 1, d)
        pe[:, 0, 0::2], pe[:, 0, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pe[: x.size(0)]


class TutorialEncoderBatchFirst(nn.Module):
    """The tutorial's encoding fed batch-first tensors: the batch index gets the position's
    encoding (the layers themselves are batch_first, so nothing fails)."""

    def __init__(self, encoding: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.pos = PositionalEncoding(16) if encoding else nn.Identity()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def forward(self, ids: Tensor, pad: Tensor) -> Tensor:
        h = self.pos(self.embed(ids))
        return self.head(self.encoder(h, src_key_padding_mask=pad))


class TutorialEncoderFixed(TutorialEncoderBatchFirst):
    def forward(self, ids: Tensor, pad: Tensor) -> Tensor:
        h = self.pos(self.embed(ids).transpose(0, 1)).transpose(0, 1)  # (seq, batch) for pe
        return self.head(self.encoder(h, src_key_padding_mask=pad))


def _tokens() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (8, 6), generator=gen)
    lengths = torch.tensor([6, 3, 5, 6, 2, 4, 6, 5])
    pad = torch.arange(6)[None] >= lengths[:, None]
    return {"ids": ids.masked_fill(pad, 0), "pad": pad, "y": torch.randint(0, 20, (8, 6))}


def _token_loss(m: nn.Module, b: Any) -> Tensor:
    logits = m(b["ids"], b["pad"])
    return F.cross_entropy(logits[~b["pad"]], b["y"][~b["pad"]])


class SortedNeverUnsorted(nn.Module):
    """Sorted by length for ``pack_padded_sequence``; the outputs are never put back."""

    def __init__(self, unsort: bool = False) -> None:
        super().__init__()
        self.rnn, self.head, self.unsort = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 10), unsort

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        lengths, order = lengths.sort(descending=True)
        packed = pack_padded_sequence(x[order], lengths, batch_first=True)
        _, (h, _) = self.rnn(packed)
        out = self.head(h[-1])
        return out[order.argsort()] if self.unsort else out


class PackedUnsortedByTorch(SortedNeverUnsorted):
    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        last = padded[torch.arange(x.shape[0]), lengths - 1]
        return self.head(last)


def _seqs() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 2, 7, 3, 7, 1, 4, 6])
    return torch.randn(8, 7, 4, generator=gen), lengths, torch.randint(0, 10, (8,), generator=gen)


def _seq_loss(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0], b[1]), b[2])


class LstmNotBatchFirst(nn.Module):
    """``nn.LSTM`` (``batch_first=False``) fed ``(batch, seq, d)``: it runs over the samples."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=batch_first)
        self.head, self.batch_first = nn.Linear(8, 10), batch_first

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _plain_seqs() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(8, 5, 4, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _seq_ce(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize(
    "make, batch, loss_fn, module",
    [
        (TutorialEncoderBatchFirst, _tokens, _token_loss, "pos"),
        (SortedNeverUnsorted, _seqs, _seq_loss, "head"),  # the LSTM returns a packed sequence
        (LstmNotBatchFirst, _plain_seqs, _seq_ce, "rnn"),
    ],
)
def test_a_result_that_depends_on_the_batch_position_is_found(
    make: Any, batch: Any, loss_fn: Any, module: str
) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    (finding,) = findings(report, CHECK)
    assert finding.severity == "error" and report.failed
    assert finding.details["samples"] and finding.details["output"].startswith("output")
    assert finding.details["module"] == module
    assert verdicts(report) == {CHECK: "finding"}


class DropPath(nn.Module):
    """Stochastic depth (timm's drop_path): one Bernoulli draw per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class NoisyResidual(nn.Module):
    """A residual MLP with drop-path, dropout, train-mode batch norm and injected noise."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)
        self.drop, self.path = nn.Dropout(0.3), DropPath(0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(torch.relu(self.bn(self.a(x))))
        h = h + self.path(h) + 0.1 * torch.randn_like(h)
        return self.b(h)


@pytest.mark.parametrize(
    "make, batch, loss_fn",
    [
        (lambda: TutorialEncoderBatchFirst(encoding=False), _tokens, _token_loss),
        (TutorialEncoderFixed, _tokens, _token_loss),
        (lambda: SortedNeverUnsorted(unsort=True), _seqs, _seq_loss),
        (PackedUnsortedByTorch, _seqs, _seq_loss),
        (lambda: LstmNotBatchFirst(batch_first=True), _plain_seqs, _seq_ce),
        (NoisyResidual, data, ce),
        (mlp, data, ce),
    ],
)
def test_correct_designs_that_resemble_them_pass(make: Any, batch: Any, loss_fn: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].details
    assert report.probes[0].details["mode"] == "train"  # the replay kept train mode


def test_a_loss_that_weighs_samples_by_place_is_found_and_can_be_declared() -> None:
    def first_half(m: nn.Module, b: Any) -> Tensor:
        out = m(b[0])
        return F.cross_entropy(out[: len(out) // 2], b[1][: len(out) // 2])

    (finding,) = findings(_probe(mlp(), data(), first_half), CHECK)
    assert finding.details["output"] is None and len(finding.details["loss"]) == 2
    # a correct episode or pair layout gives the same evidence: a warning, not an error
    assert finding.severity == "warning" and "compare_loss: false" in finding.hint
    cfg = {"checks": {**CFG["checks"], CHECK: {"compare_loss": False}}}
    assert not findings(gradwatch.probe(mlp(), data(), first_half, config=cfg), CHECK)


def test_a_forward_whose_noise_cannot_follow_the_samples_is_judged_in_eval_mode() -> None:
    class FlatNoise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 10)

        def forward(self, x: Tensor) -> Tensor:
            noise = torch.randn(x.numel()).view_as(x) if self.training else 0.0
            return self.a(x + noise)

    report = _probe(FlatNoise(), data())
    assert verdicts(report) == {CHECK: "passed"}
    assert report.probes[0].details["mode"] == "eval" and "eval mode" in report.probes[0].note


def test_the_permutation_moves_every_sample() -> None:
    for n in range(2, 40):
        perm = derangement(n)
        assert sorted(perm.tolist()) == list(range(n))
        assert not bool((perm == torch.arange(n)).any())


class CapacityMoE(nn.Module):
    """Top-1 routing to two experts of limited capacity (Switch): the first tokens of the
    batch to reach a full expert are dropped, by design."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = (
            nn.Linear(4, 2),
            nn.ModuleList(nn.Linear(4, 10) for _ in range(2)),
        )
        self.expert_capacity = 3

    def forward(self, x: Tensor) -> Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros(x.shape[0], 10)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).flatten()[: self.expert_capacity]
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_experts_of_limited_capacity_are_said_not_judged() -> None:
    torch.manual_seed(0)
    report = _probe(CapacityMoE(), data())
    assert verdicts(report) == {CHECK: "not_observed"} and not findings(report, CHECK)
    assert report.probes[0].details["reason"] == "coupled_on_purpose"


class GhostBatchNorm(nn.Module):
    """Batch norm over virtual batches of 4 in training (Hoffer et al. 2017, TabNet's GBN); with
    ``position_bias`` also a bias indexed by the sample's place in the batch (the bug)."""

    def __init__(self, position_bias: bool = False, whole: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 10)
        self.pos = nn.Parameter(torch.randn(64, 8)) if position_bias else None
        self.whole = whole

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training and not self.whole:
            h = torch.cat([self.bn(part) for part in h.split(4)])
        else:
            h = self.bn(h)
        if self.pos is not None:
            h = h + self.pos[: x.shape[0]]
        return self.head(F.relu(h))


def test_batch_norm_over_parts_of_the_batch_is_said_not_judged() -> None:
    report = _probe(GhostBatchNorm(), data())
    assert verdicts(report) == {CHECK: "not_observed"} and not findings(report, CHECK)
    details = report.probes[0].details
    assert details["reason"] == "coupled_on_purpose"
    assert "4 of 16 samples" in report.probes[0].note


@pytest.mark.parametrize("whole", [False, True])
def test_a_position_bug_next_to_batch_norm_is_still_found(whole: bool) -> None:
    """The running statistics leave the position bias moving: judged, found (and a
    whole-batch norm is never a part)."""
    report = _probe(GhostBatchNorm(position_bias=True, whole=whole), data())
    assert verdicts(report) == {CHECK: "finding"}
    assert findings(report, CHECK)[0].severity == "error"


class PairwiseLogits(nn.Module):
    """CLIP-like: image and text towers, logits between every image and every text."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        return F.normalize(self.img(x), dim=-1) @ F.normalize(self.txt(t), dim=-1).T


class MixupInForward(nn.Module):
    """Manifold mixup inside the forward: each sample mixed with a randperm partner."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training:
            h = 0.7 * h + 0.3 * h[torch.randperm(h.shape[0])]
        return self.b(h)


@pytest.mark.parametrize(
    "make, batch, loss_fn",
    [
        (
            PairwiseLogits,
            lambda: (torch.randn(8, 4), torch.randn(8, 4)),
            lambda m, b: F.cross_entropy(m(*b), torch.arange(8)),
        ),
        (MixupInForward, data, ce),
    ],
)
def test_pairwise_outputs_and_a_permutation_drawn_in_the_forward_pass(
    make: Any, batch: Any, loss_fn: Any
) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].details
