"""Canonical language designs in torch's default layouts and gradient masks: a time-major
nn.Transformer LM, skip-gram with negative sampling, embeddings with ``max_norm``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from _designs import gen, padded_tokens, token_classes
from _harness import Built, Program
from torch import nn

V = 24


class TransformerLM(nn.Module):
    """The PyTorch tutorial "Language Modeling with nn.Transformer": (seq, batch) inputs,
    sinusoidal positions, a square subsequent mask."""

    def __init__(self, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(V, d)
        pos = torch.arange(32)[:, None]
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(32, 1, d)
        pe[:, 0, 0::2], pe[:, 0, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        layer = nn.TransformerEncoderLayer(d, heads, 32, dropout=0.2)  # batch_first=False
        self.transformer_encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.linear, self.d = nn.Linear(d, V), d

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x = self.embedding(src) * math.sqrt(self.d) + self.pe[: src.size(0)]
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(0))
        return self.linear(self.transformer_encoder(x, mask))


def _tlm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    data, targets = batch
    return F.cross_entropy(model(data).view(-1, V), targets.reshape(-1))


def _transformer_lm() -> Built:
    model = TransformerLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1.0, gamma=0.95)
    g = gen(70)
    phrase = torch.randint(0, V, (5,), generator=g)
    stream = phrase.repeat(60)
    data = stream[: 4 * 70].view(4, -1).t().contiguous()  # batchify: (seq, batch)
    bptt = 10
    batches = [(data[i : i + bptt], data[i + 1 : i + 1 + bptt]) for i in range(0, 40, bptt)]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        loss = _tlm_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if i == len(batches) - 1:
            sched.step()

    return Built(model, opt, batches, step, _tlm_loss, probe_optimizer=opt)


class SkipGram(nn.Module):
    """Mikolov et al. 2013: center and context embeddings, sparse gradients."""

    def __init__(self, vocab: int = 40, d: int = 8) -> None:
        super().__init__()
        self.u = nn.Embedding(vocab, d, sparse=True)
        self.v = nn.Embedding(vocab, d, sparse=True)
        nn.init.uniform_(self.u.weight, -0.5 / d, 0.5 / d)
        nn.init.zeros_(self.v.weight)  # word2vec.c: context vectors start at zero

    def forward(self, center: torch.Tensor, context: torch.Tensor, negatives: torch.Tensor) -> Any:
        u = self.u(center)
        pos = (u * self.v(context)).sum(-1)
        neg = torch.bmm(self.v(negatives), u[:, :, None]).squeeze(-1)
        return pos, neg


def _sgns_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    pos, neg = model(*batch)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(1)).mean()


def _skipgram() -> Built:
    model = SkipGram()
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    g = gen(71)
    counts = torch.arange(40, 0, -1).float() ** 0.75  # the unigram^0.75 noise distribution
    batches = []
    for _ in range(4):
        center = torch.randint(0, 40, (32,), generator=g)
        context = (center + torch.randint(1, 3, (32,), generator=g)) % 40
        negatives = torch.multinomial(counts, 32 * 5, replacement=True, generator=g).view(32, 5)
        batches.append((center, context, negatives))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _sgns_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, _sgns_loss, probe_optimizer=opt)


class MaxNormClassifier(nn.Module):
    """Embeddings renormalised to max_norm when looked up (torch's documented in-place renorm)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16, max_norm=1.0)
        self.fc = nn.Linear(16, k)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        real = (tokens > 0).unsqueeze(-1).float()  # padding masked out, no padding_idx
        return self.fc((self.embed(tokens) * real).sum(1) / lengths[:, None].float())


def _text_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, lengths, y = batch
    return F.cross_entropy(model(tokens, lengths), y)


def _max_norm() -> Built:
    model = MaxNormClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _text_loss(model, batch).backward()
        opt.step()

    batches = token_classes(4, 8, 10, V, 3, seed=72)
    return Built(model, opt, batches, step, _text_loss, probe_optimizer=opt)


class TransformerSeq2Seq(nn.Module):
    """Vaswani et al. 2017 with nn.Transformer (batch_first): key padding masks on both sides,
    a causal target mask, a shared embedding (the PyTorch translation tutorial's Seq2SeqTransformer)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, d, padding_idx=0), nn.Embedding(16, d)
        self.transformer = nn.Transformer(d, 2, 1, 1, 32, dropout=0.1, batch_first=True)
        self.generator = nn.Linear(d, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        def emb(t: torch.Tensor) -> torch.Tensor:
            return self.embed(t) * math.sqrt(self.embed.embedding_dim) + self.pos(
                torch.arange(t.size(1))
            )

        n = tgt_in.size(1)  # boolean, as the padding masks (torch warns on mixed mask types)
        tgt_mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        out = self.transformer(
            emb(src), emb(tgt_in), tgt_mask=tgt_mask,
            src_key_padding_mask=src == 0, tgt_key_padding_mask=tgt_in == 0,
            memory_key_padding_mask=src == 0,
        )  # fmt: skip
        return self.generator(out)


def _t_s2s_batches() -> list[tuple[torch.Tensor, ...]]:
    g = gen(73)
    out = []
    for _ in range(4):
        src, lengths = padded_tokens(8, 6, V - 2, g)
        src = src + (src > 0).long() * 2  # 1 = BOS, 2 = EOS
        tgt = torch.zeros(8, 8, dtype=torch.long)
        for b in range(8):  # a copy task: the target is the source, then EOS
            n = int(lengths[b])
            tgt[b, :n], tgt[b, n] = src[b, :n], 2
        out.append((src, torch.cat([torch.ones(8, 1, dtype=torch.long), tgt[:, :-1]], 1), tgt))
    return out


def _t_s2s_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    src, tgt_in, tgt = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(
        logits.reshape(-1, V), tgt.reshape(-1), ignore_index=0, label_smoothing=0.1
    )


def _transformer_seq2seq() -> Built:
    model = TransformerSeq2Seq()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _t_s2s_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, _t_s2s_batches(), step, _t_s2s_loss, probe_optimizer=opt)


PROGRAMS = [
    Program("transformer_lm_time_major", "language model", _transformer_lm,
            "PyTorch tutorial Language Modeling with nn.Transformer ((seq, batch), causal mask)"),
    Program("transformer_seq2seq_padding", "seq2seq", _transformer_seq2seq,
            "Vaswani et al. 2017; PyTorch translation tutorial Seq2SeqTransformer (masks, smoothing)"),
    Program("skipgram_negative_sampling", "word embeddings", _skipgram,
            "Mikolov et al. 2013 word2vec SGNS (sparse embeddings, SparseAdam, unigram^0.75)"),
    Program("embedding_max_norm", "padded text classifier", _max_norm,
            "nn.Embedding(max_norm=1.0) bag-of-embeddings classifier, padding masked (torch docs)"),
]  # fmt: skip
