"""``sample_dependence``'s padding form on a library's own model (issue 50).

FNet mixes every position with a Fourier transform and takes no attention mask at all: its
outputs depend on the padding by design, which the corpus's correct Hugging Face programs
(FNet, ConvBERT, Funnel, Nystromformer, YOSO) reported as errors. On the library's own model
it is ``info``, naming the package; the same leak in the user's own pooling stays an error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _probe_models import findings, only
from torch import Tensor, nn

import gradwatch

transformers = pytest.importorskip("transformers")

CHECK = "sample_dependence"
V = 50


def _fnet() -> Any:
    torch.manual_seed(0)
    config = transformers.FNetConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, intermediate_size=32,
        max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    return transformers.FNetForMaskedLM(config)


def _batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[2, 6:], mask[2, 6:] = 0, 0  # sample 2 right-padded
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _mlm(m: nn.Module, b: dict[str, Tensor]) -> Tensor:
    return m(input_ids=b["input_ids"], labels=b["labels"]).loss


class MeanPooled(nn.Module):
    """The user's own classifier: embeddings mean-pooled over every position, padding too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(V, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(input_ids)))
        return self.head(h + h.mean(1, keepdim=True))  # the bug: pools over the padding


def test_padding_mixed_in_by_a_library_architecture_is_info() -> None:
    report = gradwatch.probe(_fnet(), _batch(), _mlm, config=only(CHECK))
    (found,) = findings(report, CHECK)
    assert found.severity == "info" and found.details["independence"] == "padding"
    assert found.details["library_design"] == "transformers" and "transformers's own" in found.hint


def test_the_same_leak_in_the_users_own_model_stays_an_error() -> None:
    def loss(m: nn.Module, b: dict[str, Tensor]) -> Tensor:
        out = m(b["input_ids"], b["attention_mask"])
        return out.logsumexp(-1).mean()

    report = gradwatch.probe(MeanPooled(), _batch(), loss, config=only(CHECK))
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and "library_design" not in found.details
