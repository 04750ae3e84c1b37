"""Console rendering of a report: a compact rich summary, plain text when not on a terminal.

The summary aims at one screen: a status header, the findings sorted by severity (at most
``MAX_ROWS``, parameters truncated with ``+N more``) and one coverage line. The JSON/HTML
report holds the rest.

Example:
    >>> print(watcher.report().summary())  # doctest: +SKIP
    gradwatch: FAILED  steps=20 backward_passes=20  findings=1 (1 error) fail_on=error
    ...
"""

from __future__ import annotations

import io
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from gradwatch.report import Finding, Report

__all__ = ["MAX_ROWS", "print_report", "render_text"]

#: Findings shown in the table; the rest are counted in a "... N more" line.
MAX_ROWS = 12
_PARAMS_SHOWN = 3
_HINT_CHARS = 160
_ORDER = {"error": 0, "warning": 1, "info": 2}
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _params(f: Finding, limit: int = _PARAMS_SHOWN) -> str:
    names = f.params or ([f.module] if f.module else [])
    shown = ", ".join(names[:limit])
    return shown + (f" +{len(names) - limit} more" if len(names) > limit else "")


def _short(text: str, limit: int = _HINT_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _header(report: Report) -> Any:
    from rich.text import Text

    head = Text("gradwatch: ")
    head.append(
        "FAILED" if report.failed else "passed", style="bold red" if report.failed else "bold green"
    )
    head.append(f"  steps={report.steps} backward_passes={report.backward_passes}")
    if report.skipped_steps:
        head.append(f" skipped_steps={report.skipped_steps}")
    head.append(f"  findings={len(report.findings)}")
    counts = [
        (sev, n)
        for sev in ("error", "warning", "info")
        if (n := sum(1 for f in report.findings if f.severity == sev))
    ]
    for k, (sev, n) in enumerate(counts):
        head.append(" (" if k == 0 else ", ")
        head.append(f"{n} {sev}" if sev == "info" else _count(n, sev), style=_STYLE[sev])
    if counts:
        head.append(")")
    head.append(f" fail_on={report.fail_on}")
    return head


def _coverage(report: Report) -> str:
    c = report.coverage
    line = (
        f"coverage: {c.trainable} trainable ({c.trainable_numel:,} elements), "
        f"{c.frozen} frozen ({c.frozen_numel:,})"
    )
    if c.optimizers:
        line += f"; {c.in_optimizer}/{c.trainable} trainable in {_count(c.optimizers, 'optimizer')}"
        extras = [
            (c.not_in_optimizer, "trainable in no optimizer"),
            (c.frozen_in_optimizer, "frozen in an optimizer"),
            (c.outside_model, "outside the model"),
        ]
        line += "".join(f", {n} {what}" for n, what in extras if n)
    else:
        line += "; no optimizer watched (each backward pass is a step)"
    return line


def _build(report: Report, *, plain: bool) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [_header(report)]
    if not report.findings:
        parts.append(Text("No findings.", style="green"))
    else:
        table = Table(
            box=box.ASCII if plain else box.SIMPLE_HEAD,
            expand=False,
            pad_edge=False,
            header_style="bold",
        )
        table.add_column("severity", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("parameters", overflow="fold")
        table.add_column("cause", overflow="fold")
        table.add_column("hint", overflow="fold")
        ordered = sorted(
            report.findings,
            key=lambda f: (_ORDER[f.severity], f.check, f.cause(), f.module or ""),
        )
        previous = None
        for f in ordered[:MAX_ROWS]:
            # A hint once: rows with the same hint are adjacent (sorted by check and cause,
            # and a ghost's hint depends on its cause); a ditto saves lines.
            text = f.hint or f.message
            hint = _short(text) if text != previous else '"'
            previous = text
            table.add_row(
                Text(f.severity, style=_STYLE[f.severity]), f.check, _params(f), f.cause(), hint
            )
        parts.append(table)
        if len(ordered) > MAX_ROWS:
            rest = len(ordered) - MAX_ROWS
            parts.append(
                Text(f"... {rest} more finding(s): see the JSON or HTML report", style="dim")
            )
    parts.append(Text(_coverage(report), style="dim"))
    return parts


def _console(file: Any, *, color: bool, width: int | None) -> Console:
    from rich.console import Console

    return Console(
        file=file,
        width=width,
        color_system="standard" if color else None,
        force_terminal=color,
        highlight=False,
        soft_wrap=False,
        emoji=False,
    )


def render_text(report: Report, *, color: bool = False, width: int = 110) -> str:
    """The summary as a string; ANSI colour only when ``color`` (ASCII table otherwise).

    Example:
        >>> print(render_text(report, width=100))  # doctest: +SKIP
    """
    buf = io.StringIO()
    console = _console(buf, color=color, width=width)
    for part in _build(report, plain=not color):
        console.print(part)
    return buf.getvalue()


def print_report(report: Report, file: Any = None) -> None:
    """Print the summary: colour on a terminal, plain ASCII text when piped.

    Example:
        >>> print_report(report)  # doctest: +SKIP
    """
    from rich.console import Console

    out = file if file is not None else sys.stdout
    if _console(out, color=False, width=None).is_terminal:
        console = Console(file=out, highlight=False, soft_wrap=False, emoji=False)
        plain = False
    else:  # piped / CI log: no ANSI codes, ASCII table, a fixed readable width
        width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else 110
        console = _console(out, color=False, width=width)
        plain = True
    for part in _build(report, plain=plain):
        console.print(part)
