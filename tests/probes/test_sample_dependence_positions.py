"""``sample_dependence`` on a learned position table read whole (``self.pos(arange(T))``,
the PyTorch translation tutorial's and nanoGPT's ``wpe``): its ``(T, d)`` output is shared by
every sample, not per-sample, even when T equals the batch size. A mix over the batch stays
an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "sample_dependence"
V, N = 20, 8


class TinyGPT(nn.Module):
    """Token and position embeddings (nanoGPT's wte + wpe(arange(T))), causal attention."""

    def __init__(self, mix_batch: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, 16), nn.Embedding(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head, self.mix_batch = nn.Linear(16, V), mix_batch

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.size(1)
        x = self.wte(ids) + self.wpe(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        h, _ = self.attn(x, x, x, attn_mask=mask)
        if self.mix_batch:  # the bug: a normaliser over the batch axis
            h = h - h.mean(0, keepdim=True)
        return self.head(h)


def tokens(t: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N, t + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]).reshape(-1, V), b[1].reshape(-1))


@pytest.mark.parametrize("t", [N, 6])  # T equal to the batch size, and not
def test_a_position_table_read_whole_is_not_a_sample(t: int) -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(TinyGPT(), tokens(t), lm_loss, config=only(CHECK))
    assert not findings(report, CHECK)
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].note


@pytest.mark.parametrize("t", [N, 6])
def test_a_mean_over_the_batch_beside_a_position_table_is_still_an_error(t: int) -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(TinyGPT(mix_batch=True), tokens(t), lm_loss, config=only(CHECK))
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and "output of wte" in found.message


class LabelEmbedding(nn.Module):
    """A conditional model: one id per sample (0..N-1 here, as arange), a softmax over dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(N, 16), nn.Linear(16, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.log_softmax(self.head(self.emb(ids)), dim=0)


def test_per_sample_ids_that_read_as_a_range_are_still_the_batch() -> None:
    torch.manual_seed(0)
    batch = (torch.arange(N), torch.randint(0, 3, (N,)))
    report = gradwatch.probe(
        LabelEmbedding(), batch, lambda m, b: F.nll_loss(m(b[0]), b[1]), config=only(CHECK)
    )
    (found,) = findings(report, CHECK)
    assert found.severity == "error"
