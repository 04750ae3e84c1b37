"""``sample_dependence`` inside a sample: what the model (causal) or its batch (an
``attention_mask``) declares must hold. Three real forms of each leak, and the correct code
that looks like them."""

from __future__ import annotations

import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "sample_dependence"
V, T, D = 40, 8, 16


def _probe(model: nn.Module, batch: Any, loss_fn: Any, **cfg: Any) -> gradwatch.Report:
    config = only(CHECK)
    config["checks"][CHECK].update(cfg)
    return gradwatch.probe(model, batch, loss_fn, config=config)


def _ids(n: int = 4) -> Tensor:
    return torch.randint(1, V, (n, T), generator=torch.Generator().manual_seed(0))


def next_token(m: Any, b: Any) -> Tensor:
    logits = m(b["input_ids"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), b["input_ids"][:, 1:].reshape(-1))


class CausalSelfAttention(nn.Module):
    """minGPT's block; ``wrong=True`` builds its mask with ``triu`` where ``tril`` belongs."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        ones = torch.ones(T, T)
        self.register_buffer("bias", torch.triu(ones) if wrong else torch.tril(ones))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split(D, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        n = x.shape[1]
        att = att.masked_fill(self.bias[:n, :n] == 0, float("-inf")).softmax(-1)
        return self.proj(att @ v)


class SdpaAttention(nn.Module):
    """Declares ``is_causal`` (as Hugging Face's attention does) and, when ``wrong``, does
    not pass it to ``scaled_dot_product_attention``."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.qkv, self.is_causal, self.wrong = nn.Linear(D, 3 * D), True, wrong

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).split(D, dim=-1)
        causal = self.is_causal and not self.wrong
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class GPT(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.attn, self.ln, self.head = attn, nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return self.head(self.ln(h + self.attn(h)))


class TorchLM(nn.Module):
    """A decoder-only LM on ``nn.TransformerEncoder``; ``masked=False`` forgets the mask."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.emb, self.masked = nn.Embedding(V, D), masked
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.enc, self.head = (
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
            nn.Linear(D, V),
        )

    def forward(self, ids: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1]) if self.masked else None
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=self.masked))


CAUSAL_CASES = {
    "mingpt_triu": (lambda wrong: GPT(CausalSelfAttention(wrong)), {}),
    "sdpa_is_causal_not_passed": (lambda wrong: GPT(SdpaAttention(wrong)), {}),
    "transformer_encoder_no_mask": (lambda wrong: TorchLM(masked=not wrong), {"causal": True}),
}


@pytest.mark.parametrize("case", sorted(CAUSAL_CASES))
def test_a_causal_model_that_sees_the_future_is_found(case: str) -> None:
    make, cfg = CAUSAL_CASES[case]
    torch.manual_seed(0)
    report = _probe(make(True), {"input_ids": _ids()}, next_token, **cfg)
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and verdicts(report) == {CHECK: "finding"}
    d = found.details
    assert d["independence"] == "causal" and d["reached_positions"]
    assert all(p > d["position"] for p in d["reached_positions"])


@pytest.mark.parametrize("case", sorted(CAUSAL_CASES))
def test_the_same_model_with_its_mask_right_passes(case: str) -> None:
    make, cfg = CAUSAL_CASES[case]
    torch.manual_seed(0)
    report = _probe(make(False), {"input_ids": _ids()}, next_token, **cfg)
    assert verdicts(report) == {CHECK: "passed"}, [f.message for f in report.findings]
    assert report.probes[0].details["declared"]["causal"] != "not declared"


def test_a_bidirectional_model_is_not_held_to_causality() -> None:
    """Undeclared, an unmasked encoder is right: nothing to judge (and it is said)."""
    report = _probe(TorchLM(masked=False), {"input_ids": _ids()}, next_token)
    assert verdicts(report) == {CHECK: "passed"}
    assert report.probes[0].details["declared"] == {
        "causal": "not declared",
        "padding": "not declared",
    }


def test_the_config_can_say_a_causal_looking_model_is_not() -> None:
    report = _probe(
        GPT(CausalSelfAttention(wrong=True)), {"input_ids": _ids()}, next_token, causal=False
    )
    assert verdicts(report) == {CHECK: "passed"}


# -- padding -----------------------------------------------------------------------------


def _padded(n: int = 4) -> dict[str, Tensor]:
    ids = _ids(n)
    mask = torch.ones(n, T, dtype=torch.long)
    for s in range(n):
        mask[s, T - 1 - s :] = 0 if s else 1  # sample s has s padded positions at its end
    mask[0] = 1
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.arange(n) % 3}


class Encoder(nn.Module):
    """A classifier on ``nn.TransformerEncoder`` with a padding mask and a pooling."""

    def __init__(self, inverted: bool = False, pool_over_padding: bool = False) -> None:
        super().__init__()
        self.emb, self.inverted, self.pool_all = nn.Embedding(V, D), inverted, pool_over_padding
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.enc, self.head = (
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
            nn.Linear(D, 3),
        )

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        keep = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        # PyTorch's key_padding_mask is True where to IGNORE: Hugging Face's mask inverted
        pad = keep.bool() if self.inverted else ~keep.bool()
        h = self.enc(self.emb(input_ids), src_key_padding_mask=pad)
        if self.pool_all:
            return self.head(h.mean(1))  # the padded positions are averaged in
        m = keep.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def classify(m: Any, b: Any) -> Tensor:
    return F.cross_entropy(m(b["input_ids"], attention_mask=b["attention_mask"]), b["labels"])


def classify_without_mask(m: Any, b: Any) -> Tensor:
    return F.cross_entropy(m(b["input_ids"]), b["labels"])


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=T, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return BertForSequenceClassification(cfg)


def hf_classify(m: Any, b: Any) -> Tensor:
    return m(**b).loss


def hf_classify_without_mask(m: Any, b: Any) -> Tensor:
    return m(input_ids=b["input_ids"], labels=b["labels"]).loss


PADDING_CASES = {
    "hf_bert_mask_not_passed": (_bert, hf_classify_without_mask, hf_classify),
    "key_padding_mask_inverted": (
        lambda bad: Encoder(inverted=bad),
        classify,
        classify,
    ),
    "mean_pool_over_padding": (
        lambda bad: Encoder(pool_over_padding=bad),
        classify,
        classify,
    ),
}


def _make(case: str, bad: bool) -> nn.Module:
    make = PADDING_CASES[case][0]
    torch.manual_seed(0)
    return make() if case.startswith("hf_") else make(bad)  # type: ignore[call-arg]


@pytest.mark.floor  # transformers
@pytest.mark.parametrize("case", sorted(PADDING_CASES))
def test_outputs_that_read_the_padding_are_found(case: str) -> None:
    _, bad_loss, _ = PADDING_CASES[case]
    report = _probe(_make(case, True), _padded(), bad_loss)
    (found,) = findings(report, CHECK)
    assert found.severity == "error", found.message
    d = found.details
    assert d["independence"] == "padding" and d["reached_positions"]
    mask = _padded()["attention_mask"][d["sample"]]
    assert all(mask[p] == 0 for p in d["reached_positions"])


@pytest.mark.floor  # transformers
@pytest.mark.parametrize("case", sorted(PADDING_CASES))
def test_outputs_that_respect_the_padding_pass(case: str) -> None:
    _, _, good_loss = PADDING_CASES[case]
    report = _probe(_make(case, False), _padded(), good_loss)
    assert verdicts(report) == {CHECK: "passed"}, [f.message for f in report.findings]
    assert report.probes[0].details["declared"]["padding"] == "the batch's attention_mask"


@pytest.mark.floor  # transformers
@pytest.mark.parametrize("side", ["right", "left"])
def test_hugging_face_gpt2_with_padding_passes_both(side: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    batch = _padded()
    if side == "left":
        batch["attention_mask"] = batch["attention_mask"].flip(1)
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def lm(m: Any, b: Any) -> Tensor:
        return m(**b, labels=b["input_ids"]).loss

    report = _probe(model, batch, lm)
    assert verdicts(report) == {CHECK: "passed"}, [f.message for f in report.findings]
    declared = report.probes[0].details["declared"]
    assert declared["causal"].startswith("GPT2Attention.is_causal")
    assert declared["padding"] == "the batch's attention_mask"


@pytest.mark.floor  # transformers
def test_an_encoder_decoder_is_not_held_to_causality() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=V, d_model=D, d_ff=32, d_kv=8, num_layers=1, num_heads=2,
                   dropout_rate=0.0, decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    batch = {"input_ids": _ids(), "labels": _ids().flip(1)}
    report = _probe(T5ForConditionalGeneration(cfg), batch, lambda m, b: m(**b).loss)
    assert verdicts(report) == {CHECK: "passed"}, [f.message for f in report.findings]
    assert report.probes[0].details["declared"]["causal"] == "not declared"


class PooledCausal(nn.Module):
    """A causal encoder whose output is pooled: no position axis to judge causality on."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt, self.head = GPT(CausalSelfAttention(wrong=True)), nn.Linear(V, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.gpt(ids).mean(1))


def test_a_declared_independence_it_cannot_judge_is_said_not_passed_over() -> None:
    batch = {"input_ids": _ids(), "labels": torch.arange(4) % 3}
    report = _probe(
        PooledCausal(), batch, lambda m, b: F.cross_entropy(m(b["input_ids"]), b["labels"])
    )
    (record,) = report.probes
    assert record.details["declared"]["causal"].startswith("CausalSelfAttention")
    assert "no position axis" in record.details["not_judged"]["causal"]
    assert record.note.startswith("declared but not judged: causal")
