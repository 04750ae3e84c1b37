"""Names are shown whole and visibly in every view (issue 44.7).

- Zero-width characters, U+061C and the other invisible format characters in a name are
  escaped in the console, the HTML report and the notebook view alike: a name that looks
  like another must not read as it.
- A long name is printed whole (docs/reports.md: names are never cut), so two 10,000-character
  names ending ``.weight`` and ``.bias`` stay told apart.
"""

from __future__ import annotations

import io
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch._text import NAME_LIMIT, name, safe

INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u061c", "\u00ad", "\U000e0041"]


class Named(nn.Module):
    """A model whose never-called layers have the given (ModuleDict) keys: ghosts."""

    def __init__(self, *keys: str) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.side = nn.ModuleDict({key: nn.Linear(4, 1) for key in keys})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ghost_report(*keys: str) -> gradwatch.Report:
    model = Named(*keys)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    report = w.report()
    assert report.by_check("ghost_param")
    return report


def _console(report: gradwatch.Report, style: str) -> str:
    out = io.StringIO()
    report.print(file=out, style=style)
    return out.getvalue()


def _views(report: gradwatch.Report, tmp_path: Path) -> dict[str, str]:
    views = {style: _console(report, style) for style in ("diagnostic", "table")}
    views["notebook"] = report._repr_html_()
    pytest.importorskip("matplotlib")
    views["html"] = report.to_html(tmp_path / "r.html").read_text(encoding="utf-8")
    return views


def test_an_invisible_character_in_a_name_is_escaped_everywhere(tmp_path: Path) -> None:
    # A ghost layer per character (one finding for them all: one subtree never called).
    keys = [f"{chr(ord('a') + k)}blo{char}ck" for k, char in enumerate(INVISIBLE)]
    report = _ghost_report(*keys)
    assert all(safe(char).startswith("\\") for char in INVISIBLE)
    for view, text in _views(report, tmp_path).items():
        for char in INVISIBLE:  # not in any name shown, nor anywhere else
            assert char not in text, f"raw U+{ord(char):04X} in the {view} view"
        assert safe(keys[0]) in text, view  # the first one shown, as its escape


def test_every_format_character_is_escaped() -> None:
    """The escaped set covers Unicode's invisible format characters (category Cf, Zl, Zp)."""
    raw = [
        chr(c)
        for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp", "Cc") and safe(chr(c)) == chr(c)
    ]
    assert not raw, [f"U+{ord(c):04X}" for c in raw[:20]]
    assert safe("plain ASCII, é, 中文, emoji 🙂") == "plain ASCII, é, 中文, emoji 🙂"


@pytest.mark.parametrize("style", ["diagnostic", "table"])
def test_long_names_are_printed_whole(style: str) -> None:
    stem = "x" * 10_000
    report = _ghost_report(stem)
    text = _console(report, style)
    assert "more characters" not in text
    for suffix in (".weight", ".bias"):
        assert f"side.{stem}{suffix}" in text.replace("\n", "").replace(" ", ""), suffix


def test_only_a_name_past_the_limit_is_shortened_keeping_both_ends() -> None:
    long = "y" * (NAME_LIMIT + 100) + ".weight"
    shown = name(long)
    assert shown.endswith("y.weight") and shown.startswith("yyy")
    assert "(107 more characters)" in shown and len(shown) < NAME_LIMIT + 100
    assert name("z" * NAME_LIMIT) == "z" * NAME_LIMIT
