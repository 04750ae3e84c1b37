"""``shared_module``: one module object registered at several sibling places."""

from __future__ import annotations

import copy

import pytest
import torch
from _built import DIM, fit, of
from torch import nn

from gradwatch.checks.shared_module import SharedModule

ID = SharedModule.id


class Block(nn.Module):
    def __init__(self, d: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], heads: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, 16)
        self.layers = nn.ModuleList(blocks)
        self.heads = nn.ModuleList([nn.Linear(16, 2) for _ in range(heads)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.layers:
            h = b(h)
        return sum(head(h) for head in self.heads) / len(self.heads)


def _repeated_block() -> nn.Module:
    return Stack([Block(16)] * 4)  # list repetition copies the reference


def _one_norm_for_all() -> nn.Module:
    norm = nn.LayerNorm(16)
    return Stack([Block(16, norm=norm) for _ in range(3)])


def _repeated_heads() -> nn.Module:
    model = Stack([Block(16) for _ in range(2)])
    mlp = nn.Linear(16, 2)
    model.heads = nn.ModuleList([mlp] * 2)
    return model


@pytest.mark.parametrize(
    ("build", "paths"),
    [
        (_repeated_block, ["layers.0", "layers.1", "layers.2", "layers.3"]),
        (_one_norm_for_all, ["layers.0.norm", "layers.1.norm", "layers.2.norm"]),
        (_repeated_heads, ["heads.0", "heads.1"]),
    ],
)
def test_one_object_in_several_sibling_places_is_named(build, paths) -> None:  # type: ignore[no-untyped-def]
    model = build()
    found = of(fit(model, torch.optim.AdamW(model.parameters(), 1e-3)), ID)
    assert len(found) == 1, found
    assert found[0].details["paths"] == paths
    assert found[0].severity == "warning"
    assert "defined_at" in found[0].details  # the line that built the container


class Albert(nn.Module):
    """One layer registered once, applied n times: sharing on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, 16)
        self.layer = Block(16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(4):
            h = self.layer(h)
        return self.out(h)


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.encoder(x), self.encoder(x.flip(0))
        return self.head(torch.cat([a, b], dim=1))


class Aliased(nn.Module):
    """``self.backbone = self.model.encoder``: one module under two unrelated names."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.ModuleDict({"encoder": nn.Linear(DIM, 16), "head": nn.Linear(16, 2)})
        self.backbone = self.model["encoder"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model["head"](torch.relu(self.backbone(x)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb((x.abs() * 3).long().clamp(0, 31)))))


def _shared_activation() -> nn.Module:
    act = nn.ReLU()  # a parameterless module used twice
    return nn.Sequential(nn.Linear(DIM, 16), act, nn.Linear(16, 16), act, nn.Linear(16, 2))


def _deep_copies() -> nn.Module:
    block = Block(16)
    return Stack([copy.deepcopy(block) for _ in range(3)])


@pytest.mark.parametrize(
    "build",
    [
        Albert,
        Siamese,
        Aliased,
        _shared_activation,
        _deep_copies,
        lambda: Stack([Block(16) for _ in range(3)]),
    ],
)
def test_look_alikes_are_silent(build) -> None:  # type: ignore[no-untyped-def]
    model = build()
    assert not of(fit(model, torch.optim.AdamW(model.parameters(), 1e-3)), ID)


def test_tied_embeddings_are_not_a_shared_module() -> None:
    model = TiedLM()
    loss = lambda m, x, y: m(x).logsumexp(-1).mean()  # noqa: E731
    report = fit(model, torch.optim.AdamW(model.parameters(), 1e-3), loss=loss)
    assert not of(report, ID)
