"""``nonfinite_param``: NaN/Inf weights behind finite gradients, on real training loops."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradwatch
from gradwatch.checks.nonfinite_param import NonfiniteParam

ID = NonfiniteParam.id


class TokenModel(nn.Module):
    """An embedding (rows not in the batch get an exactly zero gradient) and a head."""

    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def _tokens(steps: int, vocab_used: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, vocab_used, (16, 4), generator=g), torch.randn(16, 1, generator=g))
        for _ in range(steps)
    ]


def _run(model: nn.Module, opt: Any, batches: list, config: dict | None = None) -> Any:
    with gradwatch.watch(model, opt, config=config) as w:
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def test_adam_eps_zero_turns_unused_embedding_rows_nan() -> None:
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    report = _run(model, opt, _tokens(4))
    (f,) = report.by_check(ID)
    assert f.severity == "error" and f.module == "emb" and f.params == ["emb.weight"]
    assert f.first_step == 0  # the first update made them: seen at once
    assert f.details["value"] == "nan"
    assert not report.by_check("nonfinite_grad")  # rows never read: gradients stay finite


def test_token_rows_added_from_uninitialised_memory() -> None:
    """``resize_token_embeddings`` by hand: new rows copied from ``torch.empty`` (NaN here)."""
    torch.manual_seed(0)
    model = TokenModel(vocab=32)
    with torch.no_grad():
        grown = torch.empty(40, 8).fill_(float("nan"))  # what uninitialised memory may hold
        grown[:32] = model.emb.weight
        model.emb = nn.Embedding.from_pretrained(grown, freeze=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    report = _run(model, opt, _tokens(12), config={"every_n_steps": 10})
    (f,) = report.by_check(ID)
    assert f.module == "emb" and f.params == ["emb.weight"] and f.first_step == 0
    assert not report.by_check("nonfinite_grad")  # the new tokens are not in the data yet


def test_pure_fp16_weights_with_adam_default_eps() -> None:
    """``model.half()`` then Adam: eps=1e-8 rounds to 0 in fp16, a zero gradient gives 0/0."""
    torch.manual_seed(0)
    model = TokenModel().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt) as w:
        for x, y in _tokens(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()
    (f,) = w.report().by_check(ID)
    assert f.module == "emb" and f.first_step == 0


def test_clean_look_alikes_stay_silent() -> None:
    """Adam with its default eps, fp16-range large weights, and a GradScaler-free bf16 run."""
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert not _run(model, opt, _tokens(4)).by_check(ID)
    # Huge but finite weights: their float32 norm overflows to inf, the values do not.
    big = nn.Linear(8, 1)
    with torch.no_grad():
        big.weight.fill_(3e19)
    opt2 = torch.optim.SGD(big.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(big, opt2, config={"every_n_steps": 1}) as w:
        for _ in range(2):
            opt2.zero_grad()
            x = torch.randn(4, 8, generator=g) * 1e-20
            big(x).sum().backward()
            opt2.step()
    assert not w.report().by_check(ID)
    model16 = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(torch.bfloat16)
    opt3 = torch.optim.AdamW(model16.parameters(), lr=1e-3)
    with gradwatch.watch(model16, opt3, config={"every_n_steps": 1}) as w3:
        for _ in range(3):
            opt3.zero_grad()
            x = torch.randn(8, 8, generator=g, dtype=torch.float32).to(torch.bfloat16)
            model16(x).float().pow(2).mean().backward()
            opt3.step()
    assert not w3.report().by_check(ID)


def test_nonfinite_gradients_stay_one_finding_of_nonfinite_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(3):
            opt.zero_grad()
            out = model(torch.randn(8, 4))
            (out.sqrt().sum() * 0 + out.log().sum()).backward()  # NaN gradients
            opt.step()
    report = w.report()
    assert report.by_check("nonfinite_grad")
    assert not report.by_check(ID)
