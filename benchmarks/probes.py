"""What the probes cost next to one training step (``gradwatch.probe``, issue 41).

Two layouts, built here without torchvision/transformers so the script runs anywhere:

* ``resnet18``: ResNet-18's layout (BasicBlocks [2, 2, 2, 2], widths 64-512, batch norm,
  11.2 M parameters), on 32 x 32 images, batch 8;
* ``gpt2``: GPT-2's layout (token and position embeddings, pre-norm blocks of causal
  self-attention and a 4x MLP, tied head), 12 layers of d=768 (124 M parameters), 4 x 64
  tokens; ``--quick`` takes 2 layers of d=256.

For each: the time of one ordinary step (forward, backward, SGD step; the median of a few),
then each probe's own seconds (its report record), whether it sampled layers to keep its
budget, and the bytes of the copy it worked on against the model's parameter bytes. Read the
ratios (probe seconds / step seconds): machine speed cancels out.

    .venv/bin/python benchmarks/probes.py            # both layouts, default budgets
    .venv/bin/python benchmarks/probes.py --quick    # small GPT-2 layout, seconds
    .venv/bin/python benchmarks/probes.py --probes forward_not_reproducible,\
        batch_order_dependent,dependence_outside_receptive_field   # the loss-free properties
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradwatch
from gradwatch.probes import PROBES

LossFn = Callable[[nn.Module, Any], Tensor]


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for mod in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.wte(ids) + self.wpe(torch.arange(t))[None]
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def _ce(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def _next_token(m: nn.Module, b: Any) -> Tensor:
    logits = m(b[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))


def _cases(quick: bool) -> dict[str, tuple[str, nn.Module, Any, LossFn]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    images = (torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen))
    d, layers, heads = (256, 2, 4) if quick else (768, 12, 12)
    tokens = torch.randint(0, 50257, (4, 65), generator=gen)
    return {
        "resnet18": ("ResNet-18 layout, 8 x 3 x 32 x 32", ResNet18(), images, _ce),
        "gpt2": (
            f"GPT-2 layout, {layers} x d={d}, 4 x 64 tokens",
            GPT2(50257, d, layers, heads, 64),
            tokens,
            _next_token,
        ),
    }


def _step_seconds(model: nn.Module, batch: Any, loss_fn: LossFn, reps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay as built
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT-2 layout")
    parser.add_argument("--only", choices=["resnet18", "gpt2"], help="one layout")
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument(
        "--probes",
        help="comma-separated probe ids to run (default: every probe), e.g. the loss-free "
        "properties: forward_not_reproducible,batch_order_dependent,"
        "dependence_outside_receptive_field",
    )
    args = parser.parse_args()
    rows: dict[str, Any] = {"torch": torch.__version__, "machine": platform.processor()}
    for key, (what, model, batch, loss_fn) in _cases(args.quick).items():
        if args.only and key != args.only:
            continue
        step = _step_seconds(model, batch, loss_fn, reps=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        chosen = args.probes.split(",") if args.probes else list(PROBES)
        cfg = {"checks": {p: {"enabled": p in chosen} for p in PROBES}}
        report = gradwatch.probe(model, batch, loss_fn, opt, config=cfg)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"{key}: {what}; one step {step:.3f} s; parameters {weights / 2**20:.1f} MiB")
        row: dict[str, Any] = {"step_s": step, "param_bytes": weights, "probes": {}}
        for p in report.probes:
            ratio = p.seconds / step
            copy = p.memory_bytes / weights
            extra = p.note or p.details.get("reason", "")
            print(
                f"  {p.id:<34} {p.verdict:<12} {p.seconds:7.2f} s = {ratio:6.1f} steps, "
                f"copy {copy:.1f} x weights{', sampled' if p.sampled else ''}  {extra}"
            )
            row["probes"][p.id] = {
                "verdict": p.verdict,
                "seconds": p.seconds,
                "steps": ratio,
                "copy_x_weights": copy,
                "sampled": p.sampled,
                "note": extra,
            }
        rows[key] = row
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
