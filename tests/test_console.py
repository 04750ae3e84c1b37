"""The compact console table (``style="table"``): header, findings by severity, coverage.

The default diagnostic layout is tested in ``test_diagnostics.py``.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import Finding, GradWatchConfig, Report
from gradwatch.render.console import MAX_ROWS, print_report, render_text

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class GhostNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.ghost = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


def _train(model: nn.Module, config: dict | None = None, steps: int = 3) -> Report:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, **(config or {})}) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    return w.report()


def _report(findings: list[Finding], **kw: object) -> Report:
    return Report(
        gradwatch_version="0", torch_version="0", config=GradWatchConfig(), findings=findings, **kw
    )


def test_real_ghost_report_summary() -> None:
    text = render_text(_train(GhostNet()), width=120, style="table")
    head = text.splitlines()[0]
    assert head.startswith("gradwatch: FAILED")
    assert "steps=3 backward_passes=3" in head and "1 error" in head
    assert "ghost_param" in text and "ghost.weight, ghost.bias" in text
    assert "not_called" in text  # the cause column
    assert "Its module never ran" in text  # the hint
    assert "coverage: 6 trainable" in text and "6/6 trainable in 1 optimizer" in text
    assert not ANSI.search(text)
    assert all(ord(c) < 128 for c in text), "plain text must be ASCII (CI logs, pipes)"
    assert max(len(line) for line in text.splitlines()) <= 120


def test_clean_report_says_passed() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    text = render_text(_train(model), width=100, style="table")
    assert text.startswith("gradwatch: passed") and "No findings." in text


def test_findings_sorted_by_severity_with_truncated_params() -> None:
    findings = [
        Finding(check="frozen_in_optimizer", severity="info", message="m", params=["f.w"]),
        Finding(
            check="vanishing_grad",
            severity="warning",
            message="m",
            hint="raise the lr",
            params=[f"enc.{i}.weight" for i in range(7)],
            module="enc",
        ),
        Finding(
            check="nonfinite_grad",
            severity="error",
            message="m",
            params=["dec.weight"],
            details={"origin": "dec.weight"},
        ),
    ]
    text = render_text(_report(findings, failed=True, skipped_steps=2), width=140, style="table")
    assert "skipped_steps=2" in text and "(1 error, 1 warning, 1 info)" in text
    rows = [line for line in text.splitlines() if re.match(r"\|(error|warning|info)\b", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["error", "warning", "info"]
    assert "enc.0.weight, enc.1.weight, enc.2.weight +4 more" in text
    assert "enc.3.weight" not in text
    assert "dec.weight" in rows[0] and rows[0].count("dec.weight") == 2  # param + origin cause


def test_long_report_fits_about_one_screen() -> None:
    hint = "a long hint " * 40
    findings = [
        Finding(check="ghost_param", severity="error", message="m", hint=hint, params=[f"l{i}.w"])
        for i in range(40)
    ]
    text = render_text(_report(findings, failed=True), width=100, style="table")
    assert f"... {40 - MAX_ROWS} more finding(s)" in text
    assert len(text.splitlines()) <= 45
    assert text.count("a long hint") < 20  # one (shortened) hint per check, then ditto marks


def test_color_only_when_asked() -> None:
    report = _train(GhostNet())
    assert ANSI.search(render_text(report, color=True, style="table"))
    buf = io.StringIO()  # not a terminal
    print_report(report, file=buf, style="table")
    out = buf.getvalue()
    assert not ANSI.search(out) and out.startswith("gradwatch: FAILED")
    assert str(report) == report.summary()


def test_console_config_prints_at_exit(capsys: pytest.CaptureFixture[str]) -> None:
    _train(GhostNet(), config={"console": True})
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("gradwatch: FAILED")
    assert "error[ghost_param]" in out and "coverage:" in out


def test_table_rejects_an_unknown_style() -> None:
    with pytest.raises(ValueError, match="style must be one of diagnostic, table"):
        render_text(_report([]), style="fancy")
