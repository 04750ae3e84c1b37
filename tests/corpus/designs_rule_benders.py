"""Designs that bend a rule on purpose: MoE load-balancing terms, BERT's two pretraining heads,
binary nets with a straight-through Function, a full graph as one batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen
from _harness import Built, Program
from torch import nn


class SwitchMoE(nn.Module):
    """Fedus et al. 2021 Switch layer: top-1 routing, aux loss alpha * N * sum_i f_i * P_i."""

    def __init__(self, d: int = 16, experts: int = 4, top_k: int = 1) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d)) for _ in range(experts)
        )
        self.top_k, self.n = top_k, experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:  # GShard/Mixtral: renormalise the top-k gates
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = chosen == e  # (tokens, k)
            rows = hit.any(-1).nonzero().squeeze(-1)
            if rows.numel():
                gate = (weights * hit).sum(-1)[rows, None]
                out = out.index_add(0, rows, gate * expert(x[rows]))
        frac = F.one_hot(chosen, self.n).float().sum(1).mean(0) / self.top_k  # f_i
        aux = self.n * (frac * probs.mean(0)).sum()
        return out, aux


class MoEClassifier(nn.Module):
    def __init__(self, top_k: int) -> None:
        super().__init__()
        self.inp, self.moe = nn.Linear(16, 16), SwitchMoE(top_k=top_k)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        moe_out, aux = self.moe(h)
        return self.head(self.norm(h + moe_out)), aux


def _moe(top_k: int, alpha: float, seed: int) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        logits, aux = model(batch[0])
        return F.cross_entropy(logits, batch[1]) + alpha * aux

    def build() -> Built:
        model = MoEClassifier(top_k)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()

        return Built(model, opt, classes(4, 32, 16, 4, seed), step, loss_fn, probe_optimizer=opt)

    return build


class TinyBert(nn.Module):
    """Devlin et al. 2019: token + position + segment embeddings, an encoder, an MLM head tied to
    the word embeddings, a pooler (tanh on [CLS]) and the NSP head."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.tok, self.pos, self.seg = (
            nn.Embedding(vocab, d),
            nn.Embedding(16, d),
            nn.Embedding(2, d),
        )
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.1, activation="gelu",
                                           batch_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.mlm_transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.pooler, self.nsp = nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, segments: torch.Tensor, pad: torch.Tensor) -> Any:
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1))) + self.seg(segments)
        h = self.encoder(self.ln(x), src_key_padding_mask=pad)
        mlm = self.mlm_transform(h) @ self.tok.weight.t() + self.mlm_bias
        return mlm, self.nsp(torch.tanh(self.pooler(h[:, 0])))


def _bert_batches() -> list[tuple[torch.Tensor, ...]]:
    """[CLS] A [SEP] B [SEP] pairs, 15% of tokens masked (80/10/10), labels -100 elsewhere."""
    g, cls, sep, mask = gen(11), 1, 2, 3
    out = []
    for _ in range(4):
        ids = torch.zeros(8, 12, dtype=torch.long)
        segs = torch.zeros(8, 12, dtype=torch.long)
        is_next = torch.randint(0, 2, (8,), generator=g)
        for b in range(8):
            la, lb = (int(v) for v in torch.randint(2, 5, (2,), generator=g))
            a = torch.randint(4, 32, (la,), generator=g)
            nxt = (a[-1] + torch.arange(1, lb + 1)) % 28 + 4  # the true continuation
            other = torch.randint(4, 32, (lb,), generator=g)
            seq = torch.cat([torch.tensor([cls]), a, torch.tensor([sep]),
                             nxt if is_next[b] else other, torch.tensor([sep])])  # fmt: skip
            ids[b, : len(seq)] = seq
            segs[b, la + 2 : len(seq)] = 1
        pad = ids == 0
        labels = torch.full_like(ids, -100)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & (ids > sep)
        chosen[:, 1] = True  # at least one masked token per sequence
        labels[chosen] = ids[chosen]
        r = torch.rand(ids.shape, generator=g)
        masked = ids.clone()
        masked[chosen & (r < 0.8)] = mask
        rand = chosen & (r >= 0.8) & (r < 0.9)
        masked[rand] = torch.randint(4, 32, (int(rand.sum()),), generator=g)
        out.append((masked, segs, pad, labels, is_next))
    return out


def _bert_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, segs, pad, labels, is_next = batch
    mlm, nsp = model(ids, segs, pad)
    mlm_loss = F.cross_entropy(mlm.reshape(-1, mlm.size(-1)), labels.reshape(-1))
    return mlm_loss + F.cross_entropy(nsp, is_next)


def _bert() -> Built:
    model = TinyBert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _bert_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    return Built(model, opt, _bert_batches(), step, _bert_loss, probe_optimizer=opt)


class BinarizeSign(torch.autograd.Function):
    """Courbariaux et al. 2016: sign forward, the gradient passed where |x| <= 1 backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.where(x >= 0, 1.0, -1.0)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad_output * (x.abs() <= 1).to(grad_output.dtype)


class BinaryLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, BinarizeSign.apply(self.weight), self.bias)


class BinaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1 = BinaryLinear(16, 64), nn.BatchNorm1d(64)
        self.fc2, self.bn2 = BinaryLinear(64, 64), nn.BatchNorm1d(64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = BinarizeSign.apply(F.hardtanh(self.bn1(self.fc1(x))))
        h = BinarizeSign.apply(F.hardtanh(self.bn2(self.fc2(h))))
        return self.fc3(h)


def _binary_net() -> Built:
    model = BinaryNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
        with torch.no_grad():  # the real-valued latent weights stay in [-1, 1]
            for m in (model.fc1, model.fc2):
                m.weight.clamp_(-1, 1)

    return Built(model, opt, classes(4, 32, 16, 4, seed=12), step, loss_fn, probe_optimizer=opt)


class GCN(nn.Module):
    """Kipf & Welling 2017: H' = relu(A_hat H W), two layers, the whole graph each step."""

    def __init__(self, d: int = 8, h: int = 16, k: int = 3) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, k)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, a_hat: torch.Tensor) -> torch.Tensor:
        h = F.relu(a_hat @ self.w1(self.dropout(x)))
        return a_hat @ self.w2(self.dropout(h))


def _graph() -> tuple[torch.Tensor, ...]:
    g, n = gen(13), 30
    y = torch.arange(n) % 3
    p = torch.where(y[:, None] == y[None, :], 0.3, 0.03)  # a stochastic block model
    adj = (torch.rand(n, n, generator=g) < p).float().triu(1)
    adj = adj + adj.t() + torch.eye(n)  # self loops
    d = adj.sum(1).rsqrt()
    a_hat = d[:, None] * adj * d[None, :]  # D^-1/2 (A + I) D^-1/2
    x = F.one_hot(y, 8).float() + 0.8 * torch.randn(n, 8, generator=g)
    train_mask = torch.zeros(n, dtype=torch.bool)
    train_mask[:12] = True  # the semi-supervised split: a few labelled nodes
    return x, a_hat, y, train_mask


def _gcn_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, a_hat, y, mask = batch
    return F.cross_entropy(model(x, a_hat)[mask], y[mask])


def _gcn() -> Built:
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    graph = _graph()

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        opt.zero_grad()
        _gcn_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, [graph] * 4, step, _gcn_loss, probe_optimizer=opt)


class GumbelVAE(nn.Module):
    """Jang et al. 2017: a categorical latent by Gumbel-softmax, hard (straight-through) samples."""

    def __init__(self, latents: int = 4, cats: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, latents * cats))
        self.dec = nn.Sequential(nn.Linear(latents * cats, 32), nn.ReLU(), nn.Linear(32, 16))
        self.shape = (latents, cats)

    def forward(self, x: torch.Tensor, tau: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.enc(x).view(-1, *self.shape)
        z = F.gumbel_softmax(logits, tau=tau, hard=True)
        return self.dec(z.flatten(1)), logits


def _gumbel_loss(model: nn.Module, x: Any) -> torch.Tensor:
    recon, logits = model(x)
    q = logits.softmax(-1)  # KL to a uniform prior over the categories
    kl = (q * (q.clamp_min(1e-10).log() + torch.log(torch.tensor(float(q.size(-1)))))).sum((1, 2))
    return F.binary_cross_entropy_with_logits(recon, x, reduction="none").sum(1).mean() + kl.mean()


def _gumbel_vae() -> Built:
    model = GumbelVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = gen(16)
    protos = (torch.rand(4, 16, generator=g) > 0.5).float()
    batches = [protos[torch.randint(0, 4, (16,), generator=g)] for _ in range(4)]

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _gumbel_loss(model, x).backward()
        opt.step()

    return Built(model, opt, batches, step, _gumbel_loss, probe_optimizer=opt)


PROGRAMS = [
    Program("moe_switch_load_balancing", "moe", _moe(1, 0.01, 14),
            "Fedus et al. 2021 Switch Transformer top-1 router, aux loss 0.01 * N * sum f_i P_i"),
    Program("moe_top2_load_balancing", "moe", _moe(2, 0.02, 15),
            "Lepikhin et al. 2020 GShard / Mixtral top-2 routing with a load-balancing loss"),
    Program("bert_mlm_nsp", "bert pretraining", _bert,
            "Devlin et al. 2019 BERT pretraining: tied MLM head (80/10/10 masking) + NSP"),
    Program("binary_net_sign_function", "binary net", _binary_net,
            "Courbariaux et al. 2016 BinaryNet (a sign Function with a straight-through backward)"),
    Program("gcn_full_graph", "gcn", _gcn,
            "Kipf & Welling 2017 GCN, tkipf/pygcn train.py (full graph, masked labelled nodes)"),
    Program("gumbel_softmax_vae", "straight-through", _gumbel_vae,
            "Jang et al. 2017 Gumbel-softmax VAE, hard=True straight-through samples"),
]  # fmt: skip
