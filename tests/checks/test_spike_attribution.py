"""exploding_grad's spike attribution: the layers that rose most above their own running
median (``details.first_layers``), the step their rise began, in the console and HTML."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import gradwatch
from gradwatch.checks.exploding import ExplodingGrad
from gradwatch.render.diagnostics import render_diagnostics


def _spiking_run(rise_from: int, layer: int, steps: int = 20) -> gradwatch.Report:
    """A 4-layer MLP whose layer ``layer`` gradient grows 10x per step from ``rise_from``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = {"now": 0}

    def grow(grad: torch.Tensor) -> torch.Tensor:
        k = step["now"] - rise_from
        return grad * (10.0 ** (k + 1)) if k >= 0 else grad

    model[layer].weight.register_hook(grow)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    cfg = {"every_n_steps": 1, "checks": {ExplodingGrad.id: {"max_norm": None}}}
    with gradwatch.watch(model, opt, config=cfg) as w:
        for s in range(steps):
            step["now"] = s
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def test_spike_names_the_layer_that_rose_first_and_when() -> None:
    report = _spiking_run(rise_from=12, layer=2)
    found = report.by_check(ExplodingGrad.id)
    assert found, [f.line() for f in report.findings]
    first = found[0].details["first_layers"]
    assert first[0]["layer"] == "2", first
    assert first[0]["rise_began"] == 12
    assert found[0].details["rise_began"] == 12
    assert first[0]["ratio"] > 100.0
    assert all(row["layer"] != "0" for row in first)  # layers that did not rise are not named
    # plain data, through the JSON round trip
    again = gradwatch.Report.model_validate_json(report.model_dump_json())
    assert again.by_check(ExplodingGrad.id)[0].details["first_layers"] == first


def test_spike_attribution_in_console_and_html(tmp_path: Path) -> None:
    report = _spiking_run(rise_from=12, layer=4)
    text = render_diagnostics(report, width=120)
    assert "spike: 4 (" in text and "rising since step 12" in text, text
    out = tmp_path / "r.html"
    report.to_html(out)
    assert "spike from 4 (" in out.read_text()


def test_no_attribution_without_a_spike() -> None:
    report = _spiking_run(rise_from=10**6, layer=2)
    assert not report.by_check(ExplodingGrad.id)
