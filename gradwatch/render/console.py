"""Console rendering of a report: diagnostic blocks (default) or a compact table.

``style="diagnostic"`` prints one compiler-style block per finding (see
:mod:`gradwatch.render.diagnostics`) and a one-line summary; ``style="table"`` the compact
one-screen table (the findings sorted by severity, at most ``MAX_ROWS``, hints shortened).
Both use colour on a terminal only (``NO_COLOR`` turns it off, ``FORCE_COLOR`` on) and
print every name literally: rich markup in a module name is text, control bytes are escaped.

Example:
    >>> print(watcher.report().summary(width=100))  # doctest: +SKIP
    error[ghost_param]: 2 parameters of 'aux_head' got no gradient at step 0 (cause: ...
    ...
    gradwatch: FAILED  1 error in 3 steps (3 backward passes), fail_on=error
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

from gradwatch._text import clip, safe
from gradwatch.render.diagnostics import coverage_line, render_diagnostics

if TYPE_CHECKING:
    from rich.console import Console

    from gradwatch.results import Finding, ReportData

__all__ = ["MAX_ROWS", "STYLES", "print_report", "render_text"]

STYLES = ("diagnostic", "table")

#: Findings shown in the table; the rest are counted in a "... N more" line.
MAX_ROWS = 12
_PARAMS_SHOWN = 3
_HINT_CHARS = 160
_ORDER = {"error": 0, "warning": 1, "info": 2}
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _params(f: Finding, limit: int = _PARAMS_SHOWN) -> str:
    names = f.params or ([f.module] if f.module else [])
    shown = ", ".join(clip(safe(n), 400) for n in names[:limit])
    return shown + (f" +{len(names) - limit} more" if len(names) > limit else "")


def _short(text: str, limit: int = _HINT_CHARS) -> str:
    text = safe(text)
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _header(report: ReportData) -> Any:
    from rich.text import Text

    head = Text("gradwatch: ")
    verdict = report.verdict()
    head.append(verdict, style="bold green" if verdict == "passed" else "bold red")
    head.append(f"  steps={report.steps} backward_passes={report.backward_passes}")
    if report.skipped_steps:
        head.append(f" skipped_steps={report.skipped_steps}")
    shown = [f for f in report.findings if not f.baselined()]
    head.append(f"  findings={len(shown)}")
    counts = [
        (sev, n)
        for sev in ("error", "warning", "info")
        if (n := sum(f.severity == sev for f in shown))
    ]
    for k, (sev, n) in enumerate(counts):
        head.append(" (" if k == 0 else ", ")
        head.append(f"{n} {sev}" if sev == "info" else _count(n, sev), style=_STYLE[sev])
    if counts:
        head.append(")")
    if len(shown) < len(report.findings):
        head.append(f" baselined={len(report.findings) - len(shown)}")
    head.append(f" fail_on={report.fail_on}")
    return head


def _build(report: ReportData, *, plain: bool) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # Every cell is a Text: a str cell would be parsed as rich markup ("[/INST]" crashes it).
    parts: list[Any] = [_header(report)]
    findings = [f for f in report.findings if not f.baselined()]
    if not findings:
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
            findings,
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
                Text(f.severity, style=_STYLE[f.severity]),
                Text(safe(f.check)),
                Text(_params(f)),
                Text(clip(safe(f.cause()), 400)),
                Text(hint),
            )
        parts.append(table)
        if len(ordered) > MAX_ROWS:
            rest = len(ordered) - MAX_ROWS
            parts.append(
                Text(f"... {rest} more finding(s): see the JSON or HTML report", style="dim")
            )
    parts.append(Text(coverage_line(report), style="dim"))
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


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, not {style!r}")


def render_text(
    report: ReportData, *, color: bool = False, width: int = 110, style: str = "diagnostic"
) -> str:
    """The report as a string; ANSI colour only when ``color``.

    Args:
        report: the report to render.
        color: ANSI colour codes (for a terminal).
        width: the line width to wrap to.
        style: ``"diagnostic"`` (a block per finding) or ``"table"`` (compact).

    Example:
        >>> print(render_text(report, width=100))  # doctest: +SKIP
    """
    _check_style(style)
    if style == "diagnostic":
        return render_diagnostics(report, width=width, color=color)
    buf = io.StringIO()
    console = _console(buf, color=color, width=width)
    for part in _build(report, plain=not color):
        console.print(part)
    return buf.getvalue()


def _is_terminal(out: Any) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _wants_color(out: Any) -> bool:
    """Colour on a terminal, as the ``NO_COLOR``/``FORCE_COLOR`` conventions allow."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return _is_terminal(out) and os.environ.get("TERM") != "dumb"


def _width(out: Any) -> int:
    """The terminal's width; ``COLUMNS`` or 110 when piped (a CI log)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if _is_terminal(out):
        return shutil.get_terminal_size((110, 24)).columns
    return 110


def print_report(report: ReportData, file: Any = None, *, style: str = "diagnostic") -> None:
    """Print the report: colour on a terminal, plain text when piped.

    Example:
        >>> print_report(report, style="table")  # doctest: +SKIP
    """
    _check_style(style)
    out = file if file is not None else sys.stdout
    text = render_text(report, color=_wants_color(out), width=_width(out), style=style)
    out.write(text)
    flush = getattr(out, "flush", None)
    if flush is not None:
        flush()
