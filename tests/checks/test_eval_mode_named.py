"""``eval_mode_training`` with named models: each model the loop calls is a root of its own.

``watch({"G": netG, "D": netD}, ...)``: a generator left in eval mode is a root in eval (the
check's ``error``, naming G's batch norm and the line that called ``netG.eval()``), even though
the step's last forward entered D, which trains in train mode. Look-alikes that stay silent:
sampling from G in eval under ``torch.no_grad()`` and restoring ``train()``, and a generator
kept in eval only for the discriminator's sampling forwards under ``no_grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradwatch
from gradwatch.checks.eval_mode import EvalModeTraining

CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise", "console": False}
NZ, BATCH, STEPS = 8, 8, 6


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(NZ, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    d = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return g, d


def _train(g: nn.Module, d: nn.Module, *, sample_every: int = 0, restore: bool = True) -> Any:
    opt_g = torch.optim.Adam(g.parameters(), 1e-3)
    opt_d = torch.optim.Adam(d.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    with gradwatch.watch({"G": g, "D": d}, {"G": opt_g, "D": opt_d}, config=CFG) as w:
        for i in range(STEPS):
            real = torch.randn(BATCH, 4)
            with torch.no_grad():  # the discriminator's fakes: no graph into G
                fake = g(torch.randn(BATCH, NZ))
            opt_d.zero_grad()
            (bce(d(real), ones) + bce(d(fake), zeros)).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(d(g(torch.randn(BATCH, NZ))), ones).backward()
            opt_g.step()
            if sample_every and i % sample_every == 0:
                g.eval()  # a sampling helper
                with torch.no_grad():
                    g(torch.randn(2, NZ))
                if restore:
                    g.train()
    return w.report()


def _eval_findings(report: Any) -> list[Any]:
    return [f for f in report.findings if f.check == EvalModeTraining.id]


def test_a_generator_left_in_eval_is_a_root_in_eval() -> None:
    g, d = _gan()
    found = _eval_findings(_train(g, d, sample_every=2, restore=False))
    assert len(found) == 1
    (f,) = found
    assert f.severity == "error" and f.details["root"] is True
    assert f.details["modules"] == ["G:1"]  # G's batch norm, not D's dropout
    assert "test_eval_mode_named.py" in f.details["eval_called_at"]


def test_a_generator_in_eval_before_the_loop_is_a_root_in_eval() -> None:
    g, d = _gan()
    g.eval()
    found = _eval_findings(_train(g, d))
    assert [(f.severity, f.details["modules"]) for f in found] == [("error", ["G:1"])]


def test_a_discriminator_left_in_eval_is_named_by_its_dropout() -> None:
    g, d = _gan()
    d.eval()
    found = _eval_findings(_train(g, d))
    assert [(f.severity, f.details["modules"]) for f in found] == [("error", ["D:1"])]


def test_sampling_in_eval_that_restores_train_is_silent() -> None:
    g, d = _gan()
    assert _eval_findings(_train(g, d, sample_every=2, restore=True)) == []


def test_a_clean_gan_is_silent() -> None:
    g, d = _gan()
    report = _train(g, d)
    assert _eval_findings(report) == [] and not report.failed
