"""``tie_broken``: parameters meant to be one that are two objects."""

from __future__ import annotations

import pytest
import torch
from _built import fit, of
from torch import nn

from gradwatch.checks.tie_broken import TieBroken

ID = TieBroken.id
VOCAB = 32


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 4).long().clamp(0, VOCAB - 1)
        return self.head(torch.tanh(self.body(self.emb(ids))))


def _lm_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = m(x)
    target = (x.abs() * 4).long().clamp(0, VOCAB - 1).roll(1, dims=1)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _assign_loaded() -> nn.Module:
    saved = TiedLM().state_dict()
    model = TiedLM()
    model.load_state_dict(saved, assign=True)  # each name gets its own Parameter
    return model


def _rewrapped() -> nn.Module:
    model = TiedLM()
    model.head.weight = nn.Parameter(model.emb.weight.data)  # "tie" by data, not by object
    return model


def _gpt2(tied: bool = True):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _hf_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ids = (x.abs() * 4).long().clamp(0, VOCAB - 1)
    return m(input_ids=ids, labels=ids).loss


def _hf_embedding_replaced() -> nn.Module:
    model = _gpt2()
    model.transformer.wte = nn.Embedding(VOCAB, 16)  # after the head was tied to the old one
    return model


@pytest.mark.parametrize(
    ("build", "form", "loss"),
    [
        (_assign_loaded, "storage", _lm_loss),
        (_rewrapped, "storage", _lm_loss),
        (_hf_embedding_replaced, "declared", _hf_loss),
    ],
)
def test_a_tie_that_is_two_objects_is_an_error(build, form, loss) -> None:  # type: ignore[no-untyped-def]
    model = build()
    found = of(fit(model, torch.optim.AdamW(model.parameters(), 1e-3), loss=loss), ID)
    assert len(found) == 1, found
    assert found[0].severity == "error"
    assert found[0].details["form"] == form
    assert len(found[0].params) == 2


def _hf_resized() -> nn.Module:
    model = _gpt2()
    model.resize_token_embeddings(VOCAB + 8)  # re-ties the head to the new embedding
    return model


def _flat_buffer() -> nn.Module:
    """Parameters as views of one flat buffer, at different offsets (contiguous params)."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    at = 0
    for mod in model:
        for name, p in list(mod.named_parameters()):
            n = p.numel()
            setattr(mod, name, nn.Parameter(flat[at : at + n].view_as(p)))
            at += n
    return model


def _hf_ties_nothing_to_its_head() -> nn.Module:
    """A class whose ``_tied_weights_keys`` names no tie for its output embedding (Luke's
    masked LM ties only its entity head): ``tie_word_embeddings`` alone declares nothing."""
    model = _gpt2()
    model.__class__ = type("UntiedHead", (type(model),), {"_tied_weights_keys": {}})
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.mark.parametrize(
    ("build", "loss"),
    [
        (_hf_ties_nothing_to_its_head, _hf_loss),
        (TiedLM, _lm_loss),
        (_hf_resized, _hf_loss),
        (lambda: _gpt2(tied=False), _hf_loss),
        (_gpt2, _hf_loss),
        (_flat_buffer, None),
    ],
)
def test_look_alikes_are_silent(build, loss) -> None:  # type: ignore[no-untyped-def]
    model = build()
    assert not of(fit(model, torch.optim.AdamW(model.parameters(), 1e-3), loss=loss), ID)
