"""Compiler-style console output: one block per finding, then a one-line summary.

Each block has a headline (``error[ghost_param]: 2 parameters of 'aux_head' got no
gradient at step 19 ...``), then the parameters, the cause (and the cut point, when one
``.detach()`` cut them off), the source locations (with the source line when the file is at
hand), the steps and the full hint, wrapped to the width without splitting or dropping a word.
Everything is a ``rich`` ``Text`` printed through one Console (:mod:`gradwatch.render.terminal`):
colour on a terminal, plain text otherwise. Every name and text from the report is printed
literally (never parsed as markup), control bytes escaped.

Example:
    >>> print(render_diagnostics(report, width=80))  # doctest: +SKIP
    error[ghost_param]: 2 parameters of 'aux_head' got no gradient at step 0 (cause: ...
       params: aux_head.weight, aux_head.bias
    ...
    gradwatch: FAILED  1 error in 3 steps (3 backward passes), fail_on=error
"""

from __future__ import annotations

import io
import linecache
import os
from typing import TYPE_CHECKING, Any, Optional

from gradwatch._text import clip, name, safe
from gradwatch.checks.ghost import GhostParam
from gradwatch.render.terminal import hanging, make_console

if TYPE_CHECKING:
    from rich.text import Text

    from gradwatch.results import Finding, ReportData

__all__ = [
    "MAX_BLOCKS",
    "coverage_line",
    "diagnostic_lines",
    "render_diagnostics",
    "spike_layers",
    "summary_line",
]

#: Findings printed as blocks; the rest are counted in one line (the JSON/HTML report has all).
MAX_BLOCKS = 20
_PARAMS_SHOWN = 8
_LABEL = 9  # width of the right-aligned field labels
_ORDER = {"error": 0, "warning": 1, "info": 2}
_SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold cyan"}
_SNIPPET = 160


def _count(n: int, word: str, plural: str = "") -> str:
    if n == 1 or word == "info":
        return f"{n} {word}"
    return f"{n} {plural or word + 's'}"


def _snippet(location: str) -> str:
    """The source line at ``file:line``, for ``.py`` files inside the current directory only.

    A report read from disk may name any path: reading only the user's own Python sources
    keeps a crafted report from printing a line of, say, ``/proc/self/environ`` to a CI log.
    """
    path, sep, line = location.rpartition(":")
    if not sep or not line.isdigit() or not path.endswith(".py") or os.path.isabs(path):
        return ""
    try:
        cwd = os.path.realpath(os.getcwd())
        real = os.path.realpath(path)
    except OSError:
        return ""
    if not real.startswith(cwd + os.sep):
        return ""
    text = linecache.getline(real, int(line)).strip()
    return text if len(text) <= _SNIPPET else text[: _SNIPPET - 3] + "..."


def spike_layers(details: dict[str, Any]) -> str:
    """``exploding_grad``'s spike attribution in one line: the layers that rose most above
    their own running median, each with the step its rise began."""
    parts = []
    for row in details.get("first_layers") or []:
        try:
            parts.append(
                f"{row['layer']} ({float(row['ratio']):.3g}x its median, rising since step "
                f"{int(row['rise_began'])})"
            )
        except (KeyError, TypeError, ValueError):  # a hand-edited report: show what is there
            parts.append(str(row))
    return ", ".join(parts)


def _fields(f: Finding) -> list[tuple[str, str, str]]:
    """``(label, value, source line)`` rows of one finding's block."""
    rows: list[tuple[str, str, str]] = []
    names = f.params
    if names:
        shown = ", ".join(name(n) for n in names[:_PARAMS_SHOWN])  # names are never cut
        more = len(names) - _PARAMS_SHOWN
        rows.append(("params", shown + (f" +{more} more" if more > 0 else ""), ""))
    if f.module and (not names or f.check != GhostParam.id):  # a ghost names its params
        rows.append(("module", name(f.module), ""))
    details = f.details
    if details.get("cause"):
        rows.append(("cause", clip(safe(details["cause"]), 400), ""))
    elif details.get("origin"):
        rows.append(("origin", name(details["origin"]), ""))
    if details.get("cut"):  # the module whose detached output cut the params off
        rows.append(("cut", name(details["cut"]), ""))
    if details.get("ranks"):
        rows.append(("ranks", clip(safe(details["ranks"]), 400), ""))
    if details.get("first_layers"):
        rows.append(("spike", clip(safe(spike_layers(details)), 400), ""))
    for key, label in (("defined_at", "defined"), ("called_at", "called")):
        value = details.get(key)
        if isinstance(value, str) and value:
            rows.append((label, clip(safe(value), 400), safe(_snippet(value))))
    if f.first_step == f.last_step and f.count == 1:
        rows.append(("step", str(f.first_step), ""))
    else:
        rows.append(
            ("steps", f"{f.first_step}..{f.last_step} (seen {_count(f.count, 'time')})", "")
        )
    if f.hint:
        rows.append(("hint", clip(safe(f.hint)), ""))
    if f.preview():
        rows.append(("maturity", _preview_note(f), ""))
    return rows


def _preview_note(f: Finding) -> str:
    """What a preview check's finding row says: it is not judged at its own severity yet."""
    own = safe(str(f.details.get("preview_severity") or f.severity))
    if own == f.severity:
        return f"preview (at its own severity, {own}, as `preview: true` asks)"
    return f"preview: {f.severity} here; {own} with `preview: true` in the config"


def _block(f: Finding, width: int) -> list[Text]:
    from rich.text import Text

    head = Text()
    head.append(f.severity, style=_SEVERITY_STYLE[f.severity])
    preview = " (preview)" if f.preview() else ""
    head.append(f"[{safe(f.check)}]{preview}: {clip(safe(f.message))}", style="bold")
    lines = hanging(head, width, indent=2)
    pad = _LABEL + 2
    for label, value, source in _fields(f):
        first = Text().append(f"{label:>{_LABEL}}: ", style="blue")
        lines.extend(hanging(Text(value), width, indent=pad, first=first))
        if source:
            bar = Text().append(" " * pad + "| ", style="dim")
            code = Text().append(source, style="dim")
            lines.extend(hanging(code, width, indent=pad + 2, first=bar, rest=bar))
    return lines


def coverage_line(report: ReportData) -> str:
    """One line on what was watched: trainable/frozen parameters and optimizer coverage."""
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


def _passes(report: ReportData) -> str:
    """``20 backward passes``; none counted although steps ran: none reached the model (a
    ``backward()`` on a loss cut off from it is no pass of the model's), with the
    ``backward()`` calls seen when a finding counted them (``details.backward_calls``)."""
    if report.steps and not report.backward_passes:
        calls = max((f.details.get("backward_calls", 0) for f in report.findings), default=0)
        if isinstance(calls, int) and calls > 0:
            return f"{_count(calls, 'backward() call')}, none reached the model"
        return "no backward pass reached the model"
    return _count(report.backward_passes, "backward pass", "backward passes")


def summary_line(report: ReportData) -> str:
    """``gradwatch: FAILED  1 error, 2 warnings in 20 steps (20 backward passes), fail_on=error``."""
    shown = [f for f in report.findings if not f.baselined()]
    counts = [
        _count(n, sev)
        for sev in ("error", "warning", "info")
        if (n := sum(1 for f in shown if f.severity == sev))
    ]
    what = ", ".join(counts) if counts else "no findings"
    line = (
        f"gradwatch: {report.verdict()}  {what} in "
        f"{_count(report.steps, 'step')} "
        f"({_passes(report)})"
    )
    if report.skipped_steps:
        line += f", {report.skipped_steps} skipped by the scaler"
    baselined = len(report.findings) - len(shown)
    if baselined:
        line += f", {baselined} in the baseline"
    return line + f", fail_on={report.fail_on}"


def diagnostic_lines(
    report: ReportData, *, width: int = 110, limit: Optional[int] = MAX_BLOCKS
) -> list[Text]:
    """The diagnostic rendering as styled ``rich`` lines (see :func:`render_diagnostics`)."""
    from rich.text import Text

    shown = [f for f in report.findings if not f.baselined()]
    ordered = sorted(shown, key=lambda f: (_ORDER[f.severity], f.check, f.cause(), f.module or ""))
    out: list[Text] = []
    cut = ordered if limit is None else ordered[:limit]
    for f in cut:
        out.extend(_block(f, width))
        out.append(Text())
    if len(ordered) > len(cut):
        rest = len(ordered) - len(cut)
        more = (
            f"... {rest} more finding(s) not shown: see the JSON or HTML report "
            "(gradwatch report FILE --html OUT)."
        )
        out.extend(hanging(Text(more), width, indent=4))
        out.append(Text())
    out.extend(hanging(Text().append(coverage_line(report), style="dim"), width))
    summary = Text(summary_line(report))
    status = len("gradwatch: ")
    summary.stylize(  # the status word
        "bold red" if report.failed else "bold green", status, status + len(report.verdict())
    )
    out.extend(hanging(summary, width))
    return out


def render_diagnostics(
    report: ReportData, *, width: int = 110, color: bool = False, limit: Optional[int] = MAX_BLOCKS
) -> str:
    """The report as diagnostic blocks, a coverage line and a one-line summary.

    Args:
        report: the report to render.
        width: the line width to wrap to (a word longer than the line is not split).
        color: ANSI colour (a terminal); plain text otherwise.
        limit: findings shown as blocks (``None``: all); the rest are counted.

    Example:
        >>> text = render_diagnostics(report, width=80)  # doctest: +SKIP
    """
    from rich.text import Text

    buf = io.StringIO()
    console = make_console(buf, color=color, width=width)
    console.print(
        Text("\n").join(diagnostic_lines(report, width=width, limit=limit)), soft_wrap=True
    )
    return buf.getvalue()
