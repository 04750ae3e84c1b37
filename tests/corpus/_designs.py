"""Seeded data for the canonical designs (tests/corpus/designs_*.py): tiny, learnable, padded.

Each function draws from its own ``torch.Generator`` so a program's data do not depend on what
ran before it; the models are seeded by the harness (``torch.manual_seed`` before ``build``).
"""

from __future__ import annotations

import torch
from torch import nn


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def classes(n: int, bs: int, dim: int, k: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches of ``(x, y)``: Gaussian features, labels from a fixed linear teacher."""
    g = gen(seed)
    teacher = torch.randn(dim, k, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(bs, dim, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def images(
    n: int, bs: int, k: int, ch: int = 3, hw: int = 8, seed: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches of ``(images, labels)``: each class a fixed pattern plus noise."""
    g = gen(seed)
    patterns = torch.randn(k, ch, hw, hw, generator=g)
    out = []
    for _ in range(n):
        y = torch.randint(0, k, (bs,), generator=g)
        out.append((patterns[y] + 0.5 * torch.randn(bs, ch, hw, hw, generator=g), y))
    return out


def regression(n: int, bs: int, dim: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = gen(seed)
    w = torch.randn(dim, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(bs, dim, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(bs, 1, generator=g)))
    return out


def padded_tokens(
    bs: int, max_len: int, vocab: int, g: torch.Generator, min_len: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (pad 0, tokens in ``1..vocab-1``) and their lengths, longest first."""
    lengths = torch.randint(min_len, max_len + 1, (bs,), generator=g)
    lengths[0] = max_len  # a batch as a padded collate makes it: as long as its longest sample
    lengths = lengths.sort(descending=True).values
    tokens = torch.randint(1, vocab, (bs, max_len), generator=g)
    tokens[torch.arange(max_len)[None, :] >= lengths[:, None]] = 0
    return tokens, lengths


def token_classes(
    n: int, bs: int, max_len: int, vocab: int, k: int, seed: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    """``(tokens, lengths, labels)``: the label is the class of the most frequent token bucket."""
    g = gen(seed)
    out = []
    for _ in range(n):
        tokens, lengths = padded_tokens(bs, max_len, vocab, g)
        y = torch.stack([(t[t > 0] % k).bincount(minlength=k).argmax() for t in tokens])
        out.append((tokens, lengths, y))
    return out


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
