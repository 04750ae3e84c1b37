"""``Report._repr_html_``: what a notebook shows for a bare ``report`` in a cell."""

from __future__ import annotations

import sys
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

import gradwatch

VOID = {"br", "img", "meta", "hr", "input", "link", "wbr"}


class _Balance(HTMLParser):
    """Checks that every opened tag is closed in order; collects the visible text."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self.tags.append(tag)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Balance:
    parser = _Balance()
    parser.feed(page)
    parser.close()
    assert parser.stack == [], f"unclosed tags: {parser.stack}"
    return parser


def _report(ghost: bool) -> gradwatch.Report:
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Linear(4, 1)})
    if ghost:
        model["ghost"] = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as watcher:
        for _ in range(3):
            opt.zero_grad()
            model["head"](model["body"](torch.randn(2, 4))).sum().backward()
            opt.step()
    return watcher.report()


def test_failed_report_shows_its_findings_and_coverage() -> None:
    report = _report(ghost=True)
    page = report._repr_html_()
    parsed = _parse(page)
    text = " ".join(parsed.text)
    assert "FAILED" in text and "3 optimizer steps" in text
    assert "ghost_param" in text and "ghost.weight" in text and "not_called" in text
    assert "Coverage" in text and "trainable in an optimizer" in text
    assert "img" not in parsed.tags and "data:image" not in page  # no charts
    assert len(page) < 10_000  # a cell, not the 3,000-character pydantic dump times three


def test_clean_report_says_passed() -> None:
    text = " ".join(_parse(_report(ghost=False)._repr_html_()).text)
    assert "PASSED" in text and "No findings." in text


def test_notebook_repr_needs_no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert "ghost_param" in _report(ghost=True)._repr_html_()


def test_ipython_display_formatter_uses_it() -> None:
    formatters = pytest.importorskip("IPython.core.formatters")
    report = _report(ghost=True)
    html = formatters.HTMLFormatter()(report)
    assert html == report._repr_html_()
