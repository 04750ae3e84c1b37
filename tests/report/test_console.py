"""Console output: the default diagnostic layout and the compact table (``style="table"``).

The default layout prints one block per finding, every word kept, a summary line last; the
table has a header, findings by severity and coverage.
"""

from __future__ import annotations

import io
import os
import re
import select
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import Finding, GradWatchConfig, Report
from gradwatch.checks import ALL_CHECKS
from gradwatch.render.console import MAX_ROWS, print_report, render_text
from gradwatch.render.diagnostics import MAX_BLOCKS

ANSI = re.compile(r"\x1b\[[0-9;]*m")
Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    config: Optional[dict[str, object]] = None,
    zero_grad: str = "before",
    loss: Optional[Loss] = None,
) -> Report:
    torch.manual_seed(0)
    loss = loss or (lambda m, x: m(x).pow(2).mean())
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, **(config or {})}) as w:
        for _ in range(4):
            if zero_grad == "before":
                opt.zero_grad()
            loss(model, torch.randn(8, 8)).backward()
            if zero_grad == "between":  # the step_without_grad bug
                opt.zero_grad()
            opt.step()
    return w.report()


class Sick(nn.Module):
    """A ghost, a dead ReLU layer, a layer in no optimizer and a frozen one in an optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = nn.Linear(8, 8)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)  # ReLU never fires: exactly zero gradients upstream
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.ghost = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.dead(x)) + self.body(x) + self.extra(x))


@pytest.fixture(scope="module")
def every_finding() -> Report:
    """Real findings of every registered check, from real (buggy) training loops."""
    sick = Sick()
    trained = [p for n, p in sick.named_parameters() if not n.startswith(("extra", "frozen"))]
    opt = torch.optim.SGD(  # lr 0: stale; no zero_grad: missing_zero_grad
        [{"params": trained}, {"params": list(sick.frozen.parameters())}], lr=0.0
    )
    limits = {"exploding_grad": {"max_norm": 1e-6}, "vanishing_grad": {"min_mean_abs": 1e3}}
    reports = [_loop(sick, opt, config={"checks": limits}, zero_grad="never")]
    lin = nn.Linear(8, 1)
    reports.append(_loop(lin, torch.optim.SGD(lin.parameters(), lr=0.1), zero_grad="between"))
    nan = nn.Linear(8, 1)
    reports.append(
        _loop(
            nan,
            torch.optim.SGD(nan.parameters(), lr=0.1),
            loss=lambda m, x: (m(x) * float("nan")).sum(),
        )
    )
    findings = [f for r in reports for f in r.findings]
    return Report(
        gradwatch_version=gradwatch.__version__,
        torch_version=torch.__version__,
        config=GradWatchConfig(),
        steps=4,
        backward_passes=4,
        failed=True,
        findings=findings,
        coverage=reports[0].coverage,
    )


def _words(text: str) -> list[str]:
    return text.split()


def _assert_fits(text: str, width: int) -> None:
    """Lines stay within ``width`` unless one word alone is longer than the room left."""
    for line in ANSI.sub("", text).splitlines():
        if len(line) > width:
            words = line.split()
            assert len(max(words, key=len)) > width - 30, (width, line)


# The checks of SPEC section 2; a check added later should add a loop that provokes it above.
FIRST_ROUND = {
    "ghost_param",
    "missing_zero_grad",
    "step_without_grad",
    "nonfinite_grad",
    "exploding_grad",
    "vanishing_grad",
    "dead_param",
    "stale_param",
    "not_in_optimizer",
    "frozen_in_optimizer",
}


def test_every_check_is_covered(every_finding: Report) -> None:
    assert FIRST_ROUND <= {cls.id for cls in ALL_CHECKS}
    assert FIRST_ROUND <= {f.check for f in every_finding.findings}


@pytest.mark.parametrize("width", [60, 80, 120])
@pytest.mark.parametrize("color", [False, True])
def test_every_word_of_every_message_and_hint_is_printed(
    every_finding: Report, width: int, color: bool
) -> None:
    whole = render_text(every_finding, width=width, color=color)
    assert bool(ANSI.search(whole)) is color
    _assert_fits(whole, width)
    for f in every_finding.findings:
        # Rendered alone, so that a word of one finding cannot hide in another's block.
        one = every_finding.model_copy(update={"findings": [f]})
        text = ANSI.sub("", render_text(one, width=width, color=color))
        tokens = text.split()
        assert text.startswith(f"{f.severity}[{f.check}]: "), text
        for word in _words(f.message) + _words(f.hint):
            assert word in tokens, (f.check, word, width)
        # In order, too: the message and the hint read as written.
        flat = " ".join(tokens)
        assert " ".join(_words(f.message)) in flat
        assert " ".join(_words(f.hint)) in flat
        for name in f.params[:8]:
            assert name.rstrip(",") in flat
        _assert_fits(text, width)


def test_plain_mode_when_piped(every_finding: Report, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "72")
    buf = io.StringIO()  # not a terminal: a CI log
    print_report(every_finding, file=buf)
    out = buf.getvalue()
    assert "\x1b" not in out
    _assert_fits(out, 72)
    lines = out.splitlines()
    last = out[out.rindex("\ngradwatch: ") + 1 :]  # the summary, wrapped at 72 columns
    summary = " ".join(last.split())
    assert summary.startswith("gradwatch: FAILED ") and summary.endswith("fail_on=error")
    counts = {s: sum(f.severity == s for f in every_finding.findings) for s in ("error", "info")}
    assert f"{counts['error']} errors" in summary and "in 4 steps (4 backward passes)" in summary
    assert "coverage: " in out[: out.rindex("\ngradwatch: ")].rsplit("\n\n", 1)[-1]
    # Errors first, then warnings, then info.
    heads = [line.split("[")[0] for line in lines if re.match(r"^(error|warning|info)\[", line)]
    assert heads == sorted(heads, key=["error", "warning", "info"].index)
    assert len(heads) == min(len(every_finding.findings), MAX_BLOCKS)


def _on_a_terminal(report: Report) -> str:
    """What print_report writes to a real terminal device (a pseudo-terminal)."""
    leader, follower = os.openpty()
    try:
        with open(follower, "w", encoding="utf-8", closefd=False) as tty:
            print_report(report, file=tty)
        chunks = []
        while select.select([leader], [], [], 0.5)[0]:
            chunks.append(os.read(leader, 1 << 16))
        return b"".join(chunks).decode()
    finally:
        os.close(leader)
        os.close(follower)


def test_colour_on_a_terminal_and_no_colour_conventions(
    every_finding: Report, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One finding: a pseudo-terminal buffers only a few kilobytes.
    one = every_finding.model_copy(update={"findings": every_finding.by_check("ghost_param")})
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    out = _on_a_terminal(one)
    assert ANSI.search(out) and "ghost_param" in out
    monkeypatch.setenv("NO_COLOR", "1")
    out = _on_a_terminal(one)
    assert "error[ghost_param]" in out and not ANSI.search(out)
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("FORCE_COLOR", "1")
    buf = io.StringIO()
    print_report(one, file=buf)
    assert ANSI.search(buf.getvalue())


def test_blocks_beyond_the_limit_are_counted_not_dropped_silently() -> None:
    findings = [
        Finding(check="ghost_param", severity="error", message=f"m{i}", params=[f"l{i}.w"])
        for i in range(MAX_BLOCKS + 5)
    ]
    report = Report(
        gradwatch_version="0", torch_version="0", config=GradWatchConfig(), findings=findings
    )
    text = render_text(report, width=80)
    assert text.count("error[ghost_param]") == MAX_BLOCKS
    assert "... 5 more finding(s) not shown" in text


def test_clean_report_is_one_summary_line() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    report = _loop(model, torch.optim.SGD(model.parameters(), lr=0.01))
    lines = render_text(report, width=80).splitlines()
    assert (
        lines[-1] == "gradwatch: passed  no findings in 4 steps (4 backward passes), fail_on=error"
    )
    assert len(lines) == 2 and lines[0].startswith("coverage: 4 trainable")


def test_print_style_table_keeps_the_compact_table(every_finding: Report) -> None:
    buf = io.StringIO()
    every_finding.print(buf, style="table")
    out = buf.getvalue()
    assert out.startswith("gradwatch: FAILED") and "| severity | check" in out


# -- the compact table (style="table") ----------------------------------------------------


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
    rows = [line for line in text.splitlines() if re.match(r"\| (error|warning|info)\b", line)]
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
    # one hint per check (cut between words past 400 characters), then ditto marks
    assert text.count("a long hint") < 40 and "long hint ..." in text


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


class LongNames(nn.Module):
    """A ghost and a layer in no optimizer, both with long (real-model-like) names."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.encoder_attention_output_projection = nn.Linear(4, 4)  # never called: a ghost
        self.decoder_final_norm_after_residual = nn.Linear(4, 4)  # left out of the opt
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x) + self.decoder_final_norm_after_residual(x))


@pytest.fixture(scope="module")
def long_names() -> Report:
    torch.manual_seed(0)
    model = LongNames()
    trained = [p for n, p in model.named_parameters() if not n.startswith("decoder")]
    opt = torch.optim.SGD(trained, lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
    return w.report()


@pytest.mark.parametrize("width", [80, 60])
@pytest.mark.parametrize("color", [False, True])
def test_table_never_splits_a_name_or_a_word(long_names: Report, width: int, color: bool) -> None:
    assert {f.check for f in long_names.findings} == {"ghost_param", "not_in_optimizer"}
    text = ANSI.sub("", render_text(long_names, width=width, style="table", color=color))
    lines = text.splitlines()
    tokens = text.replace("|", " ").split()
    names = [n for f in long_names.findings for n in f.params]
    assert max(len(n) for n in names) == len("encoder_attention_output_projection.weight")
    for name in names:  # whole, on one line: never folded inside the identifier
        assert any(name in line for line in lines), (width, name, text)
    for f in long_names.findings:
        assert f.check in tokens
        for word in f.hint.split()[:12]:  # the hint is shortened at 160 characters
            assert word in tokens, (width, word, text)
    longest = max(len(line) for line in lines)
    if width == 80:
        assert longest <= 80, text  # these names fit 80 columns: nothing sticks out
    else:  # a name wider than the room widens the table to that name, no more
        room = 60 - len("| not_in_optimizer |  |")
        widest = max(len(n) for n in names) + 1  # and its comma
        assert widest > room and longest <= 60 + (widest - room)


def test_table_keeps_five_columns_when_the_names_leave_room(long_names: Report) -> None:
    text = render_text(long_names, width=160, style="table")
    head = next(line for line in text.splitlines() if line.startswith("| severity"))
    assert [h.strip() for h in head.strip("|").split("|")] == [
        "severity",
        "check",
        "parameters",
        "cause",
        "hint",
    ]
    narrow = render_text(long_names, width=100, style="table")
    assert "| parameters / cause / hint" in narrow and "cause: not_called" in narrow


def test_diagnostic_block_shows_the_cut_and_caps_the_params() -> None:
    grouped = Finding(
        check="ghost_param",
        severity="error",
        message="30 parameters got no gradient: the output of 'ln_f' was detached",
        hint="Remove the .detach().",
        params=[f"h.{i}.mlp.weight" for i in range(30)],
        module="h",
        details={"cause": "disconnected", "cut": "[bold]ln_f"},  # markup prints literally
    )
    text = render_text(_report([grouped], failed=True), width=80)
    lines = text.splitlines()
    assert "      cut: [bold]ln_f" in lines
    assert lines.index("    cause: disconnected") < lines.index("      cut: [bold]ln_f")
    flat = " ".join(text.split())
    assert "h.6.mlp.weight, h.7.mlp.weight +22 more" in flat and "h.8.mlp.weight" not in text
