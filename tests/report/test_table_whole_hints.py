"""``report.print(style="table")`` at 80 columns keeps every word of each hint whole.

The hint is what to do, and its last words are often the identifier to type (``encoder_stack.
feed_forward_intermediate_dense.train()``). Three real runs whose hints were cut at 160
characters: a long-named submodule left in eval, a disconnected auxiliary head, and a loose
temperature outside the model. Every word of every hint shown is in the table, whole.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from _loops import batches
from torch import nn

import gradwatch

pytest.importorskip("rich")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feed_forward_intermediate_dense = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1))
        self.feed_forward_output_dense = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward_output_dense(torch.relu(self.feed_forward_intermediate_dense(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder_stack = Block()
        self.classification_head_projection = nn.Linear(8, 1)
        self.auxiliary_reconstruction_decoder = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder_stack(x)
        self.recon = self.auxiliary_reconstruction_decoder(h).detach()
        return self.classification_head_projection(h)


def _fit(
    model: nn.Module, extra: torch.Tensor | None = None, setup: object = None
) -> gradwatch.Report:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    if callable(setup):
        setup(model)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for x, y in batches(5):
            opt.zero_grad()
            out = model(x)
            if extra is not None:
                out = out / extra
            nn.functional.mse_loss(out, y).backward()
            opt.step()
    return w.report()


def _cut_words(report: gradwatch.Report, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("COLUMNS", "80")
    buf = io.StringIO()
    report.print(buf, style="table")
    tokens = set(re.findall(r"[^\s|]+", buf.getvalue()))
    shown = {f.hint or f.message for f in report.findings}
    return [w for text in shown for w in text.split() if w not in tokens]


def test_a_long_named_submodule_left_in_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    def setup(model: nn.Module) -> None:
        model.encoder_stack.feed_forward_intermediate_dense.eval()

    report = _fit(Net(), setup=setup)
    assert report.by_check("eval_mode_training")
    assert _cut_words(report, monkeypatch) == []


def test_a_disconnected_auxiliary_head(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _fit(Net())
    (ghost,) = report.by_check("ghost_param")
    assert len(ghost.hint) > 160
    assert _cut_words(report, monkeypatch) == []


def test_a_loose_temperature_outside_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    temperature = torch.tensor(0.5, requires_grad=True)
    report = _fit(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), temperature)
    (loose,) = report.by_check("unregistered_param")
    assert len(loose.hint) > 160
    assert _cut_words(report, monkeypatch) == []
