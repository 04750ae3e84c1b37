"""``decay_on_excluded_params``: weight decay on parameters the grouping meant to exclude."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _built import DIM, fit, of
from torch import nn

from gradwatch.checks.decay_excluded import DecayOnExcludedParams

ID = DecayOnExcludedParams.id


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.proj(w @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-shaped model: its norms are ``ln_1``/``ln_2``/``ln_f``, not ``LayerNorm``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(32, d)
        self.inp = nn.Linear(DIM, d)
        self.h = nn.ModuleList([Block(d) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 4).long().clamp(0, 31)
        h = self.wte(ids) + self.inp(x).unsqueeze(1)
        for block in self.h:
            h = block(h)
        return self.head(self.ln_f(h)).mean(1)


def _groups(model: nn.Module, excluded: Any, wd: float = 0.1) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not excluded(n, p)], "weight_decay": wd},
        {"params": [p for n, p in named if excluded(n, p)], "weight_decay": 0.0},
    ]


def _hf_no_decay_list(model: nn.Module) -> torch.optim.Optimizer:
    no_decay = ["bias", "LayerNorm.weight"]  # the BERT recipe on a model that says ln_1
    return torch.optim.AdamW(_groups(model, lambda n, p: any(k in n for k in no_decay)), lr=1e-3)


def _by_name_misses_ln_f(model: nn.Module) -> torch.optim.Optimizer:
    excluded = lambda n, p: n.endswith("bias") or ".ln_" in n  # noqa: E731 (misses "ln_f")
    return torch.optim.AdamW(_groups(model, excluded), lr=1e-3)


def _adamw_everything(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # lit-llama


@pytest.mark.parametrize(
    ("make", "reason", "names"),
    [
        (_hf_no_decay_list, "unmatched", {"h.0.ln_1.weight", "ln_f.weight"}),
        (_by_name_misses_ln_f, "partial", {"ln_f.weight"}),
        (_adamw_everything, "all", {"ln_f.weight", "ln_f.bias", "h.0.ln_1.weight"}),
    ],
)
def test_decay_on_what_the_grouping_excludes_is_named(make, reason, names) -> None:  # type: ignore[no-untyped-def]
    model = GPT()
    found = of(fit(model, make(model)), ID)
    assert [f.details["reason"] for f in found] == [reason], found
    assert names <= set(found[0].params)


def _nanogpt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_groups(model, lambda n, p: p.dim() < 2), lr=1e-3, betas=(0.9, 0.95))


def _mingpt(model: nn.Module) -> torch.optim.Optimizer:
    def excluded(n: str, p: torch.Tensor) -> bool:
        return n.endswith("bias") or p.dim() < 2 or n.startswith("wte")

    return torch.optim.AdamW(_groups(model, excluded), lr=1e-3)


def _torchvision_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)


def _torchvision_norm_decay_zero(model: nn.Module) -> torch.optim.Optimizer:
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    return torch.optim.SGD(
        _groups(model, lambda n, p: id(p) in norms, wd=1e-4), lr=0.01, momentum=0.9
    )


def _adamw_default(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch's default decay, 0.01


def _hf_trainer_rule(model: nn.Module) -> torch.optim.Optimizer:
    """transformers' get_parameter_names: norms excluded by class, biases by name."""
    pytest.importorskip("transformers")
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, [nn.LayerNorm]))
    decay = {n for n in decay if "bias" not in n}
    return torch.optim.AdamW(_groups(model, lambda n, p: n not in decay), lr=1e-3)


@pytest.mark.parametrize(
    "make",
    [
        _nanogpt,
        _mingpt,
        _torchvision_sgd,
        _torchvision_norm_decay_zero,
        _adamw_default,
        _hf_trainer_rule,
    ],
)
def test_correct_groupings_are_silent(make) -> None:  # type: ignore[no-untyped-def]
    model = GPT()
    assert not of(fit(model, make(model)), ID)


def test_an_mlp_with_adamw_decaying_everything_is_no_transformer() -> None:
    model = nn.Sequential(nn.Linear(DIM, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    assert not of(fit(model, torch.optim.AdamW(model.parameters(), weight_decay=0.1)), ID)
