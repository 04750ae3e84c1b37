"""Maturity (SPEC 8.1): a preview check's findings are ``info`` unless ``preview: true``, and
say "preview" in every view; a stable check's are unchanged.

A check is put in preview here the way a maintainer does it, by its class's ``maturity``
(monkeypatched for the test, restored after); everything else is a real training loop.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from _loops import train
from torch import nn

import gradwatch
from gradwatch.checks.explain import explain_text
from gradwatch.checks.ghost import GhostParam
from gradwatch.checks.sample_dependence import SampleDependence
from gradwatch.errors import GradWatchError, GradWatchWarning
from gradwatch.render.html import render_html
from gradwatch.render.junit import junit_xml
from gradwatch.render.sarif import sarif_log

GHOST = GhostParam.id


class WithAux(nn.Module):
    """A head built and never called: ``ghost_param``, an error by default."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _run(config: dict[str, Any] | None = None) -> tuple[gradwatch.Report, list[str]]:
    """The report of a loop with a ghost head, and the GradWatchWarnings it raised."""
    model = WithAux()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = train(model, opt, steps=3, config={"warn": True, **(config or {})})
    return report, [str(w.message) for w in caught if issubclass(w.category, GradWatchWarning)]


@pytest.fixture
def ghost_in_preview(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GhostParam, "maturity", "preview")


def test_a_stable_checks_finding_is_unchanged() -> None:
    report, warned = _run()
    (f,) = report.by_check(GHOST)
    assert f.severity == "error" and report.failed
    assert "maturity" not in f.details and not f.preview()
    assert "preview" not in f.line() and "preview" not in report.summary()
    assert warned and "(preview)" not in warned[0]


@pytest.mark.usefixtures("ghost_in_preview")
def test_a_preview_checks_finding_is_info_and_fails_nothing() -> None:
    report, warned = _run()
    (f,) = report.by_check(GHOST)
    assert f.severity == "info"
    assert f.details["maturity"] == "preview" and f.details["preview_severity"] == "error"
    assert f.params == ["aux.weight", "aux.bias"]
    assert not report.failed
    assert warned == []


@pytest.mark.usefixtures("ghost_in_preview")
def test_fail_fast_follows_the_downgraded_severity() -> None:
    _run({"fail_fast": True})  # info: nothing to raise
    with pytest.raises(GradWatchError, match=r"\[error \(preview\)\] ghost_param"):
        _run({"fail_fast": True, "preview": True})


@pytest.mark.usefixtures("ghost_in_preview")
def test_with_preview_true_it_carries_its_own_severity() -> None:
    report, warned = _run({"preview": True})
    (f,) = report.by_check(GHOST)
    assert f.severity == "error" and report.failed
    assert f.details["maturity"] == "preview"
    (said,) = warned
    assert said.startswith("gradwatch ghost_param (preview) [")
    # A severity override in the config is the severity it carries with preview: true.
    report, _ = _run({"preview": True, "checks": {GHOST: {"severity": "warning"}}})
    assert [f.severity for f in report.by_check(GHOST)] == ["warning"]
    assert not report.failed


@pytest.mark.usefixtures("ghost_in_preview")
def test_every_view_says_preview() -> None:
    report, _ = _run()
    (f,) = report.by_check(GHOST)
    assert f.line().startswith("[info (preview)] ghost_param")
    text = report.summary(width=100)
    assert "info[ghost_param] (preview):" in text
    assert "maturity: preview: info here; error with `preview: true`" in text
    assert "info (preview)" in report.summary(width=160, style="table")
    data = json.loads(report.model_dump_json())
    assert data["findings"][0]["details"]["maturity"] == "preview"
    back = gradwatch.Report.model_validate_json(report.model_dump_json())
    assert back.findings[0].preview()
    result = sarif_log(report)["runs"][0]["results"][0]
    assert result["message"]["text"].startswith("(preview) ")
    assert result["properties"]["maturity"] == "preview" and result["level"] == "note"
    rules = sarif_log(report)["runs"][0]["tool"]["driver"]["rules"]
    assert next(r for r in rules if r["id"] == GHOST)["properties"]["maturity"] == "preview"
    assert "[info (preview)]" in junit_xml(report)
    assert '<small class="preview">preview</small>' in render_html(report)
    explained = explain_text(GHOST) or ""
    assert "Maturity: preview." in explained and "`preview: true`" in explained


def test_explain_says_a_stable_checks_maturity() -> None:
    assert "Maturity: stable." in (explain_text(GHOST) or "")


class _BatchSoftmax(nn.Module):
    """Normalises over the batch: ``sample_dependence``'s probe fires (an error)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=0)


def _probe(config: dict[str, Any]) -> gradwatch.Report:
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    off = {"enabled": False}
    cfg = {"checks": {"gradient_mismatch": off, "does_not_learn": off}, **config}
    return gradwatch.probe(_BatchSoftmax(), (x, y), lambda m, b: m(b[0]).sum(), config=cfg)


def test_a_probes_finding_follows_maturity_too(monkeypatch: pytest.MonkeyPatch) -> None:
    stable = _probe({})
    (f,) = stable.by_check(SampleDependence.id)
    assert f.severity == "error" and stable.failed and not f.preview()
    monkeypatch.setattr(SampleDependence, "maturity", "preview")
    report = _probe({})
    (f,) = report.by_check(SampleDependence.id)
    assert (f.severity, f.details["maturity"], report.failed) == ("info", "preview", False)
    assert f.params == ["fc.weight", "fc.bias"]  # the model judged as a whole: its parameters
    assert _probe({"preview": True}).by_check(SampleDependence.id)[0].severity == "error"
