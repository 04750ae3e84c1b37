"""``sample_dependence`` on a pairwise output: CLIP's ``(B, B)`` image-text logits (HF
CLIPModel's ``logits_per_image``), whose every row reads every sample by design, is not
judged (said so); an ``(N, N)`` output that mixes the batch beyond the pair stays an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "sample_dependence"
N = 8


class Clip(nn.Module):
    """Two encoders (the image one with batch norm or not), a learned temperature."""

    def __init__(self, norm: bool, mix_batch: bool = False) -> None:
        super().__init__()
        bn: nn.Module = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.image = nn.Sequential(nn.Linear(N, 16), bn, nn.ReLU(), nn.Linear(16, 8))
        self.text, self.scale = nn.Embedding(12, 8), nn.Parameter(torch.tensor(2.66))
        self.mix_batch = mix_batch

    def forward(self, images: Tensor, texts: Tensor) -> Tensor:
        i = F.normalize(self.image(images), dim=-1)
        if self.mix_batch:  # the bug: centred over the batch, outside any pair
            i = i - i.mean(0, keepdim=True)
        t = F.normalize(self.text(texts).mean(1), dim=-1)
        return self.scale.exp() * i @ t.t()


def pairs() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, N, generator=gen), torch.randint(0, 12, (N, 3), generator=gen)


def clip_loss(m: nn.Module, b: Any) -> Tensor:
    logits = m(*b)
    labels = torch.arange(logits.size(0))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@pytest.mark.parametrize("norm", [False, True])
def test_clip_logits_are_pairwise_and_not_judged(norm: bool) -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(Clip(norm), pairs(), clip_loss, config=only(CHECK))
    assert not [f for f in report.findings if f.severity in ("warning", "error")]
    assert verdicts(report) == {CHECK: "not_observed"}
    (record,) = report.probes
    assert record.details["reason"] == "pairwise_output" and "pairwise" in record.note


def test_clip_logits_mixed_over_the_batch_are_still_an_error() -> None:
    torch.manual_seed(0)
    report = gradwatch.probe(Clip(False, mix_batch=True), pairs(), clip_loss, config=only(CHECK))
    (found,) = findings(report, CHECK)
    assert found.severity == "error"


def test_a_softmax_over_the_batch_with_n_classes_is_still_an_error() -> None:
    """An (N, C) output with C == N by chance: one entry reads every sample."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Softmax(dim=0), nn.Linear(16, N))
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(N, 4, generator=gen), torch.randint(0, N, (N,), generator=gen))
    report = gradwatch.probe(
        model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), config=only(CHECK)
    )
    (found,) = findings(report, CHECK)
    assert found.severity == "error"
