"""The benchmark's models, data and one training step per model.

Every variant of one model gets its own copy of the same initial weights and the same
batches, so the variants do identical arithmetic and differ only by their instrumentation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

__all__ = ["MODELS", "ModelCase", "hook_bound", "large_tensors", "transformer_lm"]


@dataclass
class ModelCase:
    """A model family: how to build one (model, optimizer) and how to run one step on it."""

    key: str
    title: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

    def instances(self, n: int, seed: int = 0) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
        """``n`` identical (model, optimizer) pairs built from one seeded initialisation."""
        torch.manual_seed(seed)
        ref = self.build()
        out = []
        for _ in range(n):
            m = copy.deepcopy(ref)
            out.append((m, self.optimizer(m)))
        return out


# -- (a) hook-bound: 200 x Linear(16, 16) + Tanh, 400 parameter tensors ----------------------


def _deep_tanh() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(200):
        lin = nn.Linear(16, 16)
        # Orthogonal init keeps a 200-deep tanh stack trainable (default init makes every
        # gradient underflow to zero after ~100 layers, which would benchmark a dead net).
        nn.init.orthogonal_(lin.weight)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers)


def _tanh_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)) for _ in range(4)]


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


hook_bound = ModelCase(
    key="a",
    title="hook-bound: 200 x Linear(16,16)+Tanh (400 tensors), batch 32, SGD",
    build=_deep_tanh,
    optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-3),
    batches=_tanh_batches,
    loss=_mse,
)


# -- (b) a small transformer language model ---------------------------------------------------

VOCAB = 1000


class TinyLM(nn.Module):
    """Embedding, a 6-layer ``nn.TransformerEncoder`` (d=256, 4 heads) and a linear head."""

    def __init__(self, d: int = 256, heads: int = 4, layers: int = 6, ctx: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        block = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        n = tokens.shape[1]
        return self.head(self.encoder(h, mask=self.mask[:n, :n], is_causal=True))


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(4):
        seq = torch.randint(0, VOCAB, (8, 65), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _next_token(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


transformer_lm = ModelCase(
    key="b",
    title="6-layer TransformerEncoder LM (d=256, 4 heads, 8 x 64 tokens), AdamW",
    build=TinyLM,
    optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
    batches=_lm_batches,
    loss=_next_token,
)

MODELS: dict[str, ModelCase] = {"a": hook_bound, "b": transformer_lm}


# -- large tensors: the every-step line against clip_grad_norm_ -----------------------


def _large_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 2048, generator=g), torch.randn(64, 2048, generator=g))]


large_tensors = ModelCase(
    key="large",
    title="large tensors: 8 x Linear(2048, 2048) (33.6M parameters), batch 64, SGD",
    build=lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]),
    optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-4),
    batches=_large_batches,
    loss=_mse,
)
