"""Console rendering of a report: a rich table on a terminal, plain text elsewhere."""

from __future__ import annotations

import io
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradwatch.report import Report

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _params(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _build(report: Report) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    status = Text("FAILED", style="bold red") if report.failed else Text("passed", style="bold green")
    head = Text.assemble(
        "gradwatch: ",
        status,
        f"  steps={report.steps} backward_passes={report.backward_passes}",
        f" skipped_steps={report.skipped_steps}" if report.skipped_steps else "",
        f"  findings={len(report.findings)} fail_on={report.fail_on}",
    )
    if not report.findings:
        return [head, Text("No findings.")]
    table = Table(show_lines=False, expand=False, pad_edge=False)
    for col in ("severity", "check", "parameters", "cause", "hint"):
        table.add_column(col, overflow="fold")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(report.findings, key=lambda f: (order[f.severity], f.check, f.module or "")):
        cause = str(f.details.get("cause") or f.details.get("origin") or "")
        table.add_row(
            Text(f.severity, style=_STYLE[f.severity]),
            f.check,
            _params(f.params) or (f.module or ""),
            cause,
            f.hint,
        )
    return [head, table]


def render_text(report: Report, *, color: bool = False, width: int = 110) -> str:
    """The summary as a string; ANSI colour only when ``color``."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system="standard" if color else None,
                      force_terminal=color, highlight=False, soft_wrap=False)
    for part in _build(report):
        console.print(part)
    return buf.getvalue()


def print_report(report: Report, file: Any = None) -> None:
    """Print the summary: colour on a terminal, plain text when piped."""
    from rich.console import Console

    out = file if file is not None else sys.stdout
    console = Console(file=out, highlight=False)
    for part in _build(report):
        console.print(part)
