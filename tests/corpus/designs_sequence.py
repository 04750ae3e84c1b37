"""Canonical sequence designs: language models (truncated BPTT), seq2seq with teacher forcing,
CTC, padded text classifiers (``padding_idx``), a transformer encoder classifier."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import gen, padded_tokens, token_classes
from _harness import Built, Program
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

V = 24  # vocabulary (0 is padding where there is padding)


class RNNModel(nn.Module):
    """pytorch/examples word_language_model RNNModel (LSTM, tied weights), tiny."""

    def __init__(self, ntoken: int = V, nhid: int = 16) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(ntoken, nhid)
        self.rnn = nn.LSTM(nhid, nhid, 2, dropout=0.2)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight  # Press & Wolf 2017 weight tying
        self.nhid = nhid

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, bsz, self.nhid), torch.zeros(2, bsz, self.nhid)


def _corpus_stream(n: int, seed: int) -> torch.Tensor:
    """A token stream with structure: a repeated random phrase with some noise."""
    g = gen(seed)
    phrase = torch.randint(0, V, (7,), generator=g)
    stream = phrase.repeat(n // 7 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.1
    stream[noise] = torch.randint(0, V, (int(noise.sum()),), generator=g)
    return stream


def _batchify(stream: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = stream.size(0) // bsz
    return stream[: nbatch * bsz].view(bsz, -1).t().contiguous()


def _tbptt_lm() -> Built:
    model = RNNModel()
    data = _batchify(_corpus_stream(4 * 8 * 6 + 4, 0), 4)  # (seq, batch)
    bptt, lr, clip = 8, 5.0, 0.25
    chunks = [(data[i : i + bptt], data[i + 1 : i + 1 + bptt]) for i in range(0, 4 * bptt, bptt)]
    state: dict[str, Any] = {"hidden": model.init_hidden(4)}

    def repackage_hidden(h: Any) -> Any:
        """Wraps hidden states in new Tensors, to detach them from their history."""
        if isinstance(h, torch.Tensor):
            return h.detach()
        return tuple(repackage_hidden(v) for v in h)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        data, targets = batch  # word_language_model main.py train(), as written there
        model.train()
        state["hidden"] = repackage_hidden(state["hidden"])
        model.zero_grad()
        output, state["hidden"] = model(data, state["hidden"])
        loss = F.cross_entropy(output.view(-1, V), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        out, _ = model(batch[0], model.init_hidden(batch[0].size(1)))
        return F.cross_entropy(out.view(-1, V), batch[1].reshape(-1))

    return Built(model, None, chunks, step, loss_fn)


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm = nn.Embedding(V, 16), nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def _lm_loss(model: nn.Module, x: Any) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1))


def _lstm_lm() -> Built:
    model = LSTMLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    stream = _corpus_stream(4 * 8 * 13, 1)
    batches = [stream[k * 104 : (k + 1) * 104].view(8, 13) for k in range(4)]

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _lm_loss(model, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return Built(model, opt, batches, step, _lm_loss, probe_optimizer=opt)


class Seq2Seq(nn.Module):
    """The PyTorch seq2seq tutorial's GRU encoder-decoder, packed source, padded targets."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(V, h, padding_idx=0)
        self.tgt_embed = nn.Embedding(V, h, padding_idx=0)
        self.encoder, self.decoder = nn.GRU(h, h, batch_first=True), nn.GRU(h, h, batch_first=True)
        self.out = nn.Linear(h, V)

    def forward(self, src: torch.Tensor, lengths: torch.Tensor, tgt_in: torch.Tensor) -> Any:
        packed = pack_padded_sequence(self.src_embed(src), lengths, batch_first=True)
        _, hidden = self.encoder(packed)
        dec, _ = self.decoder(self.tgt_embed(tgt_in), hidden)  # teacher forcing
        return self.out(dec)


def _s2s_batches() -> list[tuple[torch.Tensor, ...]]:
    g = gen(2)
    out = []
    for _ in range(4):
        src, lengths = padded_tokens(8, 6, V - 2, g)
        src = src + (src > 0).long() * 2  # tokens 3..V-1; 1 = BOS, 2 = EOS
        tgt = torch.zeros(8, 8, dtype=torch.long)
        for b in range(8):  # the target is the source reversed, then EOS
            n = int(lengths[b])
            tgt[b, :n] = src[b, :n].flip(0)
            tgt[b, n] = 2
        tgt_in = torch.cat([torch.ones(8, 1, dtype=torch.long), tgt[:, :-1]], 1)
        out.append((src, lengths, tgt_in, tgt))
    return out


def _s2s_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    src, lengths, tgt_in, tgt = batch
    logits = model(src, lengths, tgt_in)
    return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), ignore_index=0)


def _seq2seq() -> Built:
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _s2s_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return Built(model, opt, _s2s_batches(), step, _s2s_loss, probe_optimizer=opt)


class CTCModel(nn.Module):
    def __init__(self, feats: int = 8, h: int = 16, labels: int = 6) -> None:
        super().__init__()
        self.rnn = nn.LSTM(feats, h, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * h, labels)  # label 0 is CTC's blank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0]).log_softmax(2)


def _ctc_batches() -> list[tuple[torch.Tensor, ...]]:
    g = gen(3)
    protos = torch.randn(6, 8, generator=g)
    out = []
    for _ in range(4):
        tlen = torch.randint(2, 5, (6,), generator=g)
        targets = torch.randint(1, 6, (6, 4), generator=g)
        frames = torch.zeros(6, 12, 8)
        in_len = torch.zeros(6, dtype=torch.long)
        for b in range(6):  # each label held for two frames, then silence
            seq = targets[b, : tlen[b]].repeat_interleave(2)
            frames[b, : len(seq)] = protos[seq]
            in_len[b] = len(seq) + 2
        frames = frames + 0.1 * torch.randn(frames.shape, generator=g)
        out.append((frames, targets, in_len, tlen))
    return out


def _ctc_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, targets, in_len, tlen = batch
    log_probs = model(x).transpose(0, 1)  # (T, N, C) as nn.CTCLoss wants
    return F.ctc_loss(log_probs, targets, in_len, tlen, blank=0, zero_infinity=True)


def _ctc() -> Built:
    model = CTCModel()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ctc_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, _ctc_batches(), step, _ctc_loss, probe_optimizer=opt)


class GRUClassifier(nn.Module):
    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16, padding_idx=0)
        self.gru, self.fc = nn.GRU(16, 16, batch_first=True), nn.Linear(16, k)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True)
        _, h = self.gru(packed)
        return self.fc(h[-1])


class BagOfEmbeddings(nn.Module):
    """Padding rows are zero (padding_idx) and summed away; the mean divides by true lengths."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.embed, self.fc = nn.Embedding(V, 16, padding_idx=0), nn.Linear(16, k)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(tokens).sum(1) / lengths[:, None].float())


class EmbeddingBagClassifier(nn.Module):
    """The PyTorch text classification tutorial's TextClassificationModel (offsets, no padding)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.embedding, self.fc = nn.EmbeddingBag(V, 16), nn.Linear(16, k)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        flat = tokens[tokens > 0]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        return self.fc(self.embedding(flat, offsets))


class PaddedTransformerClassifier(nn.Module):
    def __init__(self, k: int = 3, d: int = 16) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, d, padding_idx=0), nn.Embedding(16, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(d, k)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        x = self.embed(tokens) + self.pos(torch.arange(tokens.size(1)))
        h = self.encoder(x, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.fc((h * keep).sum(1) / keep.sum(1))  # mean over the real tokens


def _text_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, lengths, y = batch
    return F.cross_entropy(model(tokens, lengths), y)


def _text(cls: type[nn.Module], lr: float, seed: int) -> Any:
    def build() -> Built:
        model = cls()
        opt = torch.optim.Adam(model.parameters(), lr=lr)

        def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
            opt.zero_grad()
            _text_loss(model, batch).backward()
            opt.step()

        batches = token_classes(4, 8, 10, V, 3, seed=seed)
        return Built(model, opt, batches, step, _text_loss, probe_optimizer=opt)

    return build


class CausalSelfAttention(nn.Module):
    """karpathy/nanoGPT CausalSelfAttention: one qkv projection, scaled_dot_product is_causal."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.c_attn(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MiniGPT(nn.Module):
    def __init__(self, d: int = 16, block: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(block, d)
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), CausalSelfAttention(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, V, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.lm_head(self.ln_f(x))


def _gpt() -> Built:
    model = MiniGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    stream = _corpus_stream(4 * 8 * 13, 8)
    batches = [stream[k * 104 : (k + 1) * 104].view(8, 13) for k in range(4)]

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        _lm_loss(model, x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Built(model, opt, batches, step, _lm_loss, probe_optimizer=opt)


PROGRAMS = [
    Program("tbptt_lstm_lm", "truncated bptt", _tbptt_lm,
            "pytorch/examples word_language_model main.py (repackage_hidden, manual SGD, clip)"),
    Program("lstm_lm", "language model", _lstm_lm, "Mikolov/Zaremba LSTM LM, next-token CE"),
    Program("seq2seq_teacher_forcing", "seq2seq", _seq2seq,
            "Sutskever et al. 2014; PyTorch seq2seq tutorial (teacher forcing, padded targets)"),
    Program("ctc_bilstm", "ctc", _ctc, "Graves et al. 2006 CTC; torch nn.CTCLoss docs"),
    Program("gru_classifier_padding_idx", "padded text classifier",
            _text(GRUClassifier, 3e-3, 4),
            "packed GRU text classifier, nn.Embedding(padding_idx=0), right-padded batches"),
    Program("bag_of_embeddings_padding_idx", "padded text classifier",
            _text(BagOfEmbeddings, 1e-2, 5),
            "Joulin et al. 2017 fastText-style bag of embeddings, padding row zeroed and summed"),
    Program("embedding_bag_offsets", "padded text classifier",
            _text(EmbeddingBagClassifier, 1e-2, 6),
            "PyTorch text classification tutorial (nn.EmbeddingBag with offsets)"),
    Program("transformer_encoder_classifier", "transformer classifier",
            _text(PaddedTransformerClassifier, 1e-3, 7),
            "Vaswani et al. 2017 encoder; nn.TransformerEncoder with src_key_padding_mask"),
    Program("nanogpt_causal_lm", "language model", _gpt,
            "Radford et al. 2019 GPT-2; karpathy/nanoGPT model.py (is_causal SDPA, tied head)"),
]  # fmt: skip
