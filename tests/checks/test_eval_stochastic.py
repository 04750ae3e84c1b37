"""``eval_forward_stochastic``: dropout run as in training in an eval-mode forward.

Bug forms, as practitioners report them ("model.eval() does not turn off F.dropout"): a
custom GPT block's ``F.dropout(att, 0.1)``, a segmentation decoder's
``F.dropout2d(feat, 0.3)``, an RNN language model's embedding dropout
``F.dropout(emb, self.p)``; each is seen in a validation pass after training steps and in
one after the last step. Clean: ``training=self.training``, ``nn.Dropout``, Monte-Carlo
dropout through ``nn.Dropout`` modules put back in train mode, and Tacotron 2's prenet
(dropout on at inference by design) once ``ignore`` names it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn
from torch.nn.functional import dropout as _bound_dropout

import gradwatch

ID = "eval_forward_stochastic"


class Block(nn.Module):
    def __init__(self, respect: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.respect = respect

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1)
        att = F.dropout(att, 0.1, training=self.training) if self.respect else F.dropout(att, 0.1)
        return x + self.proj(att @ v)


class TinyGPT(nn.Module):
    def __init__(self, respect: bool = False, mc: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList([Block(respect) for _ in range(2)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(ids))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class SegDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.cls = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls(F.dropout2d(torch.relu(self.conv(x)), 0.3))


class RNNLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.out = nn.Linear(16, 50)
        self.p = 0.2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(F.dropout(self.emb(ids), self.p))
        return self.out(h)


class Prenet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = F.dropout(torch.relu(lin(x)), p=0.5, training=True)  # on by design
        return x


class Tacotronish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.prenet = Prenet()
        self.decoder = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        h, _ = self.decoder(self.prenet(frames))
        return self.out(h)


def _tokens(k: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(k))


def _run(model: nn.Module, make: Any, loss: Any, validate_after: bool = False, **cfg: Any) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config={**CFG, **cfg}) as w:
        for k in range(4):
            model.train()
            opt.zero_grad()
            loss(model(make(k)), make(k)).backward()
            opt.step()
            if k == 1 or (validate_after and k == 3):
                model.eval()
                with torch.no_grad():
                    model(make(100 + k))
    return w.report()


def _lm(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, 50), ids.reshape(-1))


def _found(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == ID]


def test_gpt_block_functional_dropout_names_each_block() -> None:
    found = _found(_run(TinyGPT(), _tokens, _lm))
    assert sorted(f.module for f in found) == ["blocks.0", "blocks.1"]
    f = found[0]
    assert f.severity == "warning" and f.details["function"] == "dropout"
    assert "test_eval_stochastic.py" in f.details["called_at"]
    assert f.params == [
        "blocks.0.qkv.weight",
        "blocks.0.qkv.bias",
        "blocks.0.proj.weight",
        "blocks.0.proj.bias",
    ]


def test_segmentation_dropout2d() -> None:
    def make(k: int) -> torch.Tensor:
        return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(k))

    (f,) = _found(_run(SegDecoder(), make, lambda out, x: out.pow(2).mean()))
    assert f.details["function"] == "dropout2d" and f.module == "SegDecoder"


def test_rnn_lm_embedding_dropout_seen_after_the_last_step() -> None:
    (f,) = _found(_run(RNNLM(), _tokens, _lm, validate_after=True, every_n_steps=1))
    assert f.details["p"] == 0.2


def test_respecting_the_mode_and_mc_dropout_modules_are_silent() -> None:
    assert not _found(_run(TinyGPT(respect=True), _tokens, _lm))
    model = TinyGPT(respect=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config=CFG) as w:
        opt.zero_grad()
        _lm(model(_tokens(0)), _tokens(0)).backward()
        opt.step()
        model.eval()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.train()  # Monte-Carlo dropout, on purpose
        with torch.no_grad():
            model(_tokens(1))
    assert not _found(w.report())


def _frames(k: int) -> torch.Tensor:
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(k))


def test_tacotron_prenet_fires_and_is_silenced_by_ignore() -> None:
    def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(out, x)

    (f,) = _found(_run(Tacotronish(), _frames, loss))
    assert f.module == "prenet"
    assert not _found(_run(Tacotronish(), _frames, loss, ignore=["prenet.*"]))


def test_functions_are_restored_after_the_scan() -> None:
    before = F.dropout
    _run(TinyGPT(), _tokens, _lm, checks={ID: {"scan_forwards": 1}})
    assert F.dropout is before


class BoundBlock(nn.Module):
    """A block whose module imported ``dropout`` by name before any watching (issue 51.7)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _bound_dropout(self.lin(x), 0.1)  # training=True by default: ignores eval


class BoundLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.block = BoundBlock()
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def test_dropout_bound_by_name_before_watching_is_seen() -> None:
    (f,) = _found(_run(BoundLM(), _tokens, _lm))
    assert f.module == "block" and f.details["function"] == "dropout"
    assert "test_eval_stochastic.py" in f.details["called_at"]
