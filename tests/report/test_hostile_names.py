"""Hostile module names: rich markup prints literally, escape and control bytes never reach a
terminal raw (console, warnings, exceptions, the CLI, a saved report from elsewhere)."""

from __future__ import annotations

import io
import json
import re
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.cli.main import main

MARKUP = ["[/INST]", "[bold]loud", "[link=https://x]y[/link]"]
ESCAPES = [
    "\x1b[31mred\x1b[0m",
    "\x1b]8;;https://evil\x07click\x1b]8;;\x07",
    "over\rwrite",
    "\u202eabc",
]
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the console's own colour codes


def raw_controls(text: str) -> list[str]:
    """Control or bidi characters left in ``text`` once the console's own colours are removed."""
    return re.findall("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", SGR.sub("", text))


class Hostile(nn.Module):
    """Ghost layers (never called) named with markup and escape sequences. One head of
    ``heads`` is called, so each hostile head is a ghost (a finding) of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.heads = nn.ModuleDict({name: nn.Linear(4, 1) for name in ["ok", *MARKUP, *ESCAPES]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.heads["ok"](x)


def _train(model: nn.Module) -> tuple[gradwatch.Report, list[str]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradwatch.watch(model, opt) as w:
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 4)).pow(2).mean().backward()
                opt.step()
    return w.report(), [str(c.message) for c in caught if c.category is gradwatch.GradWatchWarning]


def test_watch_print_and_raise_with_hostile_names(monkeypatch: pytest.MonkeyPatch) -> None:
    report, messages = _train(Hostile())
    names = {f.module for f in report.by_check("ghost_param")}
    assert names == {f"heads.{n}" for n in MARKUP + ESCAPES}  # the report keeps the real names
    assert len(messages) == len(names)  # one warning per finding
    for message in messages:
        assert not raw_controls(message), message
    assert any("[heads.[/INST] (2 parameters)]" in m for m in messages)
    assert any("heads.\\x1b[31mred\\x1b[0m" in m for m in messages)
    for style in ("diagnostic", "table"):
        for force in ("", "1"):  # plain, then colour (the rich path of the table)
            monkeypatch.setenv("FORCE_COLOR", force)
            buf = io.StringIO()
            report.print(buf, style=style)
            out = buf.getvalue()
            assert not raw_controls(out), (style, force)
            assert "heads.[/INST]" in out and "[bold]loud" in out
            assert "\\x1b]8;;https://evil\\x07click" in out or style == "table"
    with pytest.raises(gradwatch.GhostLayerError) as info:
        report.raise_for_findings()
    assert not raw_controls(str(info.value)) and "[/INST]" in str(info.value)


def test_fail_fast_message_is_escaped() -> None:
    model = Hostile()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradwatch.GhostLayerError) as info:
        with gradwatch.watch(model, opt, config={"fail_fast": True, "warn": False}):
            opt.zero_grad()
            model(torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
    assert not raw_controls(str(info.value)) and "\\x1b[31mred" in str(info.value)


def test_cli_check_with_hostile_names_writes_every_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "hostile_target.py"
    target.write_text(
        textwrap.dedent(
            f"""
            import torch
            from torch import nn
            import gradwatch

            NAMES = {MARKUP + ESCAPES!r}

            class Hostile(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = nn.Linear(4, 1)
                    self.heads = nn.ModuleDict({{n: nn.Linear(4, 1) for n in ["ok", *NAMES]}})

                def forward(self, x):
                    return self.body(x) + self.heads["ok"](x)

            def build():
                model = Hostile()
                return gradwatch.Probe(
                    model=model,
                    batch=(torch.randn(8, 4), torch.randn(8, 1)),
                    loss_fn=lambda m, b: (m(b[0]) - b[1]).pow(2).mean(),
                )
            """
        ),
        encoding="utf-8",
    )
    out_json, junit, sarif = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.sarif"
    args = [f"{target}:build", "--json", str(out_json), "--junit", str(junit)]
    assert main(["check", *args, "--sarif", str(sarif)]) == 1
    captured = capsys.readouterr()
    assert not raw_controls(captured.out + captured.err)
    assert "heads.[/INST]" in captured.out
    saved = gradwatch.Report.read(out_json)
    # every error is one of the hostile heads (a probe may add an info not_observed of its own)
    errors = {f.module for f in saved.findings if f.severity != "info"}
    assert errors == {f"heads.{n}" for n in MARKUP + ESCAPES}
    assert not raw_controls(junit.read_text(encoding="utf-8"))
    json.loads(sarif.read_text(encoding="utf-8"))
    assert main(["report", str(out_json), "--style", "table"]) == 1
    captured = capsys.readouterr()
    assert not raw_controls(captured.out + captured.err) and "[/INST]" in captured.out


def test_report_of_an_untrusted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"
    untrusted = {
        "gradwatch_version": "0",
        "torch_version": "0",
        "config": {},
        "failed": True,
        "findings": [
            {
                "check": f"ghost_param{evil}",
                "severity": "error",
                "message": f"message {evil} [bold]",
                "hint": f"hint {evil} [bold]",
                "params": [f"w{evil}"],
                "module": f"m{evil}",
                "details": {
                    "cause": evil,
                    "origin": evil,
                    "ranks": [evil],
                    "defined_at": f"{evil}.py:1",
                    "called_at": "/proc/self/environ:1",
                },
            }
        ],
    }
    path = tmp_path / "untrusted.json"
    path.write_text(json.dumps(untrusted), encoding="utf-8")
    for style in ("diagnostic", "table"):
        assert main(["report", str(path), "--style", style]) == 1
        captured = capsys.readouterr()
        assert not raw_controls(captured.out + captured.err), style
        assert "[bold]" in captured.out
    # A location outside the current directory (or not Python) is named, never read out.
    assert main(["report", str(path)]) == 1
    out = capsys.readouterr().out
    assert "/proc/self/environ:1" in out and "\n           | " not in out


def test_lightning_fit_completes_and_prints_hostile_names_literally(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from _lightning_helpers import Regressor, loader, trainer

    from gradwatch.lightning import GradWatchCallback

    class HostileRegressor(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleDict({name: nn.Linear(8, 1) for name in MARKUP + ESCAPES})

    cb = GradWatchCallback(config={"warn": False})
    trainer(tmp_path, cb).fit(HostileRegressor(), loader())  # no crash after the fit
    assert cb.report is not None
    # the heads are never called: one subtree, one finding listing every hostile name
    (ghost,) = cb.report.by_check("ghost_param")
    assert ghost.module == "heads"
    assert set(ghost.details["layers"]) == {f"heads.{n}" for n in MARKUP + ESCAPES}
    out = capsys.readouterr().out
    assert "heads.[/INST]" in out and "[bold]loud" in out and not raw_controls(out)
