"""What one root cause prints: console lines and Python warnings for three field cases.

Each case is one bug in a realistic model, trained for a few steps under ``gradwatch.watch``:

(a) one ``.detach()`` before the final norm of a 12-block nanoGPT-style model;
(b) learning rate 0 on the no-decay param group of AdamW (nanoGPT's two groups);
(c) an optimizer built on the decoder only of an encoder-decoder.

It prints, per case, the number of findings, of lines that ``report.print()`` writes and of
``GradWatchWarning`` s raised, then (``--show``) the console output itself::

    .venv/bin/python benchmarks/one_cause_output.py          # the figures
    .venv/bin/python benchmarks/one_cause_output.py --show   # and the output
"""

from __future__ import annotations

import argparse
import io
import math
import warnings
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

import gradwatch

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 96, 16, 32, 4, 12


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's layout: token and position embeddings, blocks, ln_f, a tied lm_head."""

    def __init__(self, detach_before_ln_f: bool = False) -> None:
        super().__init__()
        self.detach = detach_before_ln_f
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, EMBD),
                wpe=nn.Embedding(BLOCK, EMBD),
                h=nn.ModuleList([Block() for _ in range(LAYERS)]),
                ln_f=nn.LayerNorm(EMBD),
            )
        )
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        if self.detach:
            x = x.detach()  # the bug of case (a)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def adamw_groups(model: nn.Module, lr: float, nodecay_lr: float) -> torch.optim.Optimizer:
    """nanoGPT's ``configure_optimizers``: 2-D weights decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": nodecay, "weight_decay": 0.0, "lr": nodecay_lr},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _gpt_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (4, BLOCK), generator=g),
            torch.randint(VOCAB, (4, BLOCK), generator=g),
        )
        for _ in range(n)
    ]


def _train_gpt(model: GPT, opt: torch.optim.Optimizer, steps: int) -> None:
    for idx, targets in _gpt_batches(steps):
        opt.zero_grad(set_to_none=True)
        model(idx, targets).backward()
        opt.step()


def case_detach(steps: int) -> tuple[nn.Module, Callable[[], None], torch.optim.Optimizer]:
    model = GPT(detach_before_ln_f=True)
    opt = adamw_groups(model, 3e-4, 3e-4)
    return model, lambda: _train_gpt(model, opt, steps), opt


def case_lr_zero(steps: int) -> tuple[nn.Module, Callable[[], None], torch.optim.Optimizer]:
    model = GPT()
    opt = adamw_groups(model, 3e-4, 0.0)  # the no-decay group at lr 0
    return model, lambda: _train_gpt(model, opt, steps), opt


class Seq2Seq(nn.Module):
    """A small encoder-decoder (``nn.Transformer``-style) with embeddings and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, EMBD)
        self.tgt_emb = nn.Embedding(VOCAB, EMBD)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(EMBD, HEADS, 4 * EMBD, dropout=0.0, batch_first=True), 3
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(EMBD, HEADS, 4 * EMBD, dropout=0.0, batch_first=True), 3
        )
        self.head = nn.Linear(EMBD, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.src_emb(src) * math.sqrt(EMBD))
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.decoder(self.tgt_emb(tgt), memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


def case_decoder_only(steps: int) -> tuple[nn.Module, Callable[[], None], torch.optim.Optimizer]:
    model = Seq2Seq()
    # The bug: the optimizer built on the decoder side only (decoder, its embedding, head).
    decoder_side = [
        *model.decoder.parameters(),
        *model.tgt_emb.parameters(),
        *model.head.parameters(),
    ]
    opt = torch.optim.Adam(decoder_side, lr=1e-3)

    def train() -> None:
        g = torch.Generator().manual_seed(2)
        for _ in range(steps):
            src = torch.randint(VOCAB, (4, BLOCK), generator=g)
            tgt = torch.randint(VOCAB, (4, BLOCK), generator=g)
            opt.zero_grad()
            logits = model(src, tgt[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, 1:].reshape(-1)).backward()
            opt.step()

    return model, train, opt


CASES = {
    "a_detach_before_ln_f": case_detach,
    "b_nodecay_group_lr0": case_lr_zero,
    "c_optimizer_on_decoder_only": case_decoder_only,
}


def run_case(name: str, steps: int = 8) -> tuple[int, int, int, str]:
    """(findings, console lines, warnings, console text) of one case."""
    torch.manual_seed(0)
    model, train, opt = CASES[name](steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt) as watcher:
            train()
    report = watcher.report()
    out = io.StringIO()
    report.print(out)
    text = out.getvalue()
    n_warn = sum(1 for w in caught if issubclass(w.category, gradwatch.GradWatchWarning))
    return len(report.findings), len(text.splitlines()), n_warn, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print each case's console output")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    print(f"{'case':30} {'findings':>8} {'lines':>6} {'warnings':>8}")
    for name in CASES:
        findings, lines, n_warn, text = run_case(name, args.steps)
        print(f"{name:30} {findings:>8} {lines:>6} {n_warn:>8}")
        if args.show:
            print(text)


if __name__ == "__main__":
    main()
