"""Console rendering of a report: diagnostic blocks (default) or a compact table.

``style="diagnostic"`` prints one compiler-style block per finding (see
:mod:`gradwatch.render.diagnostics`) and a one-line summary; ``style="table"`` the compact
one-screen table (the findings sorted by severity, at most ``MAX_ROWS``, each hint whole).
Both print through one ``rich`` Console (:mod:`gradwatch.render.terminal`): colour on a
terminal only, as rich reads ``NO_COLOR``/``FORCE_COLOR``/``TERM``, and every name literally
(markup in a module name is text, control bytes are escaped).

The table never splits an identifier: the severity, check, parameter and cause columns do not
wrap inside a word, and only the hint column wraps (on word boundaries). When the parameter
names leave the hint column fewer than ``HINT_MIN`` columns, the table has two: the severity
over the check id, and the parameters, cause and hint stacked (a 55-character name fits 80
columns); a name wider than the whole line widens the table rather than being cut.

Example:
    >>> print(watcher.report().summary(width=100))  # doctest: +SKIP
    error[ghost_param]: 2 parameters of 'aux_head' got no gradient at step 0 (cause: ...
    ...
    gradwatch: FAILED  1 error in 3 steps (3 backward passes), fail_on=error
"""

from __future__ import annotations

import io
import sys
from typing import TYPE_CHECKING, Any, Optional

from gradwatch._text import clip, name, safe
from gradwatch.render.diagnostics import coverage_line, diagnostic_lines
from gradwatch.render.terminal import hanging, longest_word, make_console

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from gradwatch.results import Finding, ReportData

__all__ = ["HINT_MIN", "MAX_ROWS", "STYLES", "print_report", "render_text"]

STYLES = ("diagnostic", "table")

#: Findings shown in the table; the rest are counted in a "... N more" line.
MAX_ROWS = 12
#: The narrowest hint column of the five-column table; narrower, the rows stack.
HINT_MIN = 30
_PARAMS_SHOWN = 3
_HINT_CHARS = 400
_ORDER = {"error": 0, "warning": 1, "info": 2}
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _params(f: Finding, limit: int = _PARAMS_SHOWN) -> str:
    names = f.params or ([f.module] if f.module else [])
    shown = ", ".join(name(n) for n in names[:limit])  # whole: never cut
    return shown + (f" +{len(names) - limit} more" if len(names) > limit else "")


def _short(text: str, limit: int = _HINT_CHARS) -> str:
    # Whole up to a length no hint of gradwatch's reaches (its last words are often the
    # identifier to use: ``encoder_stack.feed_forward_intermediate_dense.train()``); longer
    # text (a hostile name in it) is cut between words, never inside one.
    text = safe(text)
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    return text[: cut if cut > 0 else limit - 3].rstrip() + " ..."


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _header(report: ReportData) -> Text:
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


def _rows(findings: list[Finding]) -> list[tuple[Finding, str, str]]:
    """``(finding, cause, hint)`` of the rows shown, a repeated hint as a ditto mark."""
    ordered = sorted(
        findings, key=lambda f: (_ORDER[f.severity], f.check, f.cause(), f.module or "")
    )
    rows = []
    previous = None
    for f in ordered[:MAX_ROWS]:
        # A hint once: rows with the same hint are adjacent (sorted by check and cause, and a
        # ghost's hint depends on its cause); a ditto saves lines.
        text = f.hint or f.message
        rows.append((f, clip(safe(f.cause()), 400), _short(text) if text != previous else '"'))
        previous = text
    return rows


def _table(rows: list[tuple[Finding, str, str]], width: int, plain: bool) -> tuple[Any, int]:
    """The findings table and its width (wider than ``width`` only for a name that is)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    sev_w = max(len("severity"), *(len(f.severity_label()) for f, _, _ in rows))
    check_w = max(len("check"), *(len(safe(f.check)) for f, _, _ in rows))
    cause_w = max(len("cause"), *(longest_word(c) for _, c, _ in rows))
    name_w = max(len("parameters"), *(longest_word(_params(f)) for f, _, _ in rows))
    params_max = max(len(_params(f)) for f, _, _ in rows)
    hint_max = max(len(h) for _, _, h in rows)
    edge = 2 if plain else 0  # the plain table is framed, the coloured one is not

    def rules(columns: int) -> int:  # the separators and padding of a row
        return 3 * columns - 1 + edge

    room = width - (sev_w + check_w + cause_w + rules(5))
    wide = room - name_w >= HINT_MIN
    table = Table(
        box=box.ASCII if plain else box.SIMPLE_HEAD,
        expand=False,
        pad_edge=True,  # rich 13 counts the edge padding even without it: same layout in both
        show_edge=plain,
        header_style="bold",
    )
    # Every cell is a Text: a str cell would be parsed as rich markup ("[/INST]" crashes it).
    if wide:
        table.add_column("severity", no_wrap=True, width=sev_w)
        table.add_column("check", no_wrap=True, width=check_w)
        params_w = min(params_max, max(name_w, room * 2 // 5, room - hint_max), room - HINT_MIN)
        params_w = max(params_w, name_w, len("parameters"))
        hint_w = min(room - params_w, max(hint_max, len("hint")))
        table.add_column("parameters", width=params_w, overflow="fold")
        table.add_column("cause", width=cause_w, overflow="fold")
        table.add_column("hint", width=hint_w, overflow="fold")
        for f, cause, hint in rows:
            table.add_row(
                Text(f.severity_label(), style=_STYLE[f.severity]),
                Text(safe(f.check)),
                Text(_params(f)),
                Text(cause),
                Text(hint),
            )
        return table, sev_w + check_w + params_w + cause_w + hint_w + rules(5)
    # Stacked: the severity over the check id, and the parameters, cause and hint one under
    # the other in the last column (about 60 columns of 80 for the names).
    id_w = max(sev_w, check_w)
    detail_w = max(width - (id_w + rules(2)), name_w, len("cause: ") + cause_w, 20)
    table.add_column("finding", no_wrap=True, width=id_w)
    table.add_column("parameters / cause / hint", width=detail_w, overflow="fold")
    for f, cause, hint in rows:
        detail = Text(_params(f))
        if cause:
            detail.append("\ncause: ", style="dim")
            detail.append(cause)
        detail.append("\n" + hint)
        finding = Text().append(f.severity_label(), style=_STYLE[f.severity])
        finding.append("\n" + safe(f.check))
        table.add_row(finding, detail)
    return table, id_w + detail_w + rules(2)


def _table_parts(report: ReportData, width: int, *, plain: bool) -> tuple[list[Any], int]:
    """What the table style prints, and the width its widest part needs."""
    from rich.text import Text

    parts: list[Any] = hanging(_header(report), width)
    needed = width
    findings = [f for f in report.findings if not f.baselined()]
    if not findings:
        parts.append(Text("No findings.", style="green"))
    else:
        table, needed = _table(_rows(findings), width, plain)
        parts.append(table)
        if len(findings) > MAX_ROWS:
            rest = len(findings) - MAX_ROWS
            more = Text(f"... {rest} more finding(s): see the JSON or HTML report", style="dim")
            parts.extend(hanging(more, width))
    parts.extend(hanging(Text().append(coverage_line(report), style="dim"), width))
    return parts, max(needed, width)


def _emit(console: Console, report: ReportData, style: str, width: Optional[int]) -> None:
    from rich.text import Text

    width = width if width is not None else console.width
    if style == "diagnostic":
        console.print(Text("\n").join(diagnostic_lines(report, width=width)), soft_wrap=True)
        return
    parts, needed = _table_parts(report, width, plain=console.color_system is None)
    console.width = needed  # a name wider than the line widens the table, never is cut
    for part in parts:
        console.print(part, soft_wrap=isinstance(part, Text))


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
    buf = io.StringIO()
    _emit(make_console(buf, color=color, width=width), report, style, width)
    return buf.getvalue()


def print_report(report: ReportData, file: Any = None, *, style: str = "diagnostic") -> None:
    """Print the report: colour on a terminal, plain text when piped (rich decides).

    The width is ``COLUMNS``, the terminal's, or 110 in a pipe (a CI log).

    Example:
        >>> print_report(report, style="table")  # doctest: +SKIP
    """
    _check_style(style)
    out = file if file is not None else sys.stdout
    _emit(make_console(out, color=None, width=None), report, style, None)
    flush = getattr(out, "flush", None)
    if flush is not None:
        flush()
