"""Compiler-style console output: one block per finding, then a one-line summary.

Each block has a headline (``error[ghost_param]: 2 parameters of 'aux_head' got no
gradient at step 19 ...``), then the parameters, the cause, the source locations (with the
source line when the file is at hand), the steps and the full hint, wrapped to the width
without splitting or dropping a word. Colour is ANSI on a terminal, nothing in plain mode.
Every name and text from the report is printed literally, control bytes escaped.

Example:
    >>> print(render_diagnostics(report, width=80))  # doctest: +SKIP
    error[ghost_param]: 2 parameters of 'aux_head' got no gradient at step 0 (cause: ...
       params: aux_head.weight, aux_head.bias
    ...
    gradwatch: FAILED  1 error in 3 steps (3 backward passes), fail_on=error
"""

from __future__ import annotations

import linecache
import os
import textwrap
from typing import TYPE_CHECKING, Any, Optional

from gradwatch._text import clip, safe
from gradwatch.checks.ghost import GhostParam

if TYPE_CHECKING:
    from gradwatch.results import Finding, ReportData

__all__ = ["MAX_BLOCKS", "render_diagnostics", "spike_layers"]

#: Findings printed as blocks; the rest are counted in one line (the JSON/HTML report has all).
MAX_BLOCKS = 20
_PARAMS_SHOWN = 8
_LABEL = 9  # width of the right-aligned field labels
_ORDER = {"error": 0, "warning": 1, "info": 2}
_COLOR = {"error": "1;31", "warning": "1;33", "info": "1;36"}
_SNIPPET = 160


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color and text else text


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """Word-wrap ``text`` after ``first`` (continuations after ``rest``); never split a word."""
    wrapper = textwrap.TextWrapper(
        width=max(width, len(first) + 20),
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return wrapper.wrap(text) or [first.rstrip()]


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
        shown = ", ".join(clip(safe(n), 400) for n in names[:_PARAMS_SHOWN])
        more = len(names) - _PARAMS_SHOWN
        rows.append(("params", shown + (f" +{more} more" if more > 0 else ""), ""))
    if f.module and (not names or f.check != GhostParam.id):  # a ghost names its params
        rows.append(("module", clip(safe(f.module), 400), ""))
    details = f.details
    if details.get("cause"):
        rows.append(("cause", clip(safe(details["cause"]), 400), ""))
    elif details.get("origin"):
        rows.append(("origin", clip(safe(details["origin"]), 400), ""))
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
    return rows


def _block(f: Finding, width: int, color: bool) -> list[str]:
    tag = f"{f.severity}[{safe(f.check)}]:"
    head = _wrap(f"{tag} {clip(safe(f.message))}", width, "", "  ")
    if color:
        rest = head[0][len(tag) :]
        head[0] = _paint(f.severity, _COLOR[f.severity], True) + _paint(
            tag[len(f.severity) :] + rest, "1", True
        )
    lines = head
    pad = " " * (_LABEL + 2)
    for label, value, source in _fields(f):
        first = f"{label:>{_LABEL}}: "
        wrapped = _wrap(value, width, first, pad)
        if color:
            wrapped[0] = _paint(first, "34", True) + wrapped[0][len(first) :]
        lines.extend(wrapped)
        if source:
            code = _wrap(source, width, pad + "| ", pad + "| ")
            lines.extend(_paint(c, "2", color) for c in code)
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
        f"({_count(report.backward_passes, 'backward pass', 'backward passes')})"
    )
    if report.skipped_steps:
        line += f", {report.skipped_steps} skipped by the scaler"
    baselined = len(report.findings) - len(shown)
    if baselined:
        line += f", {baselined} in the baseline"
    return line + f", fail_on={report.fail_on}"


def _summary(report: ReportData, width: int, color: bool) -> list[str]:
    lines = _wrap(summary_line(report), width, "", "  ")
    if color:  # "gradwatch: " is 11 characters; the status word follows
        status = lines[0][11:17]
        lines[0] = (
            lines[0][:11]
            + _paint(status, "1;31" if report.failed else "1;32", True)
            + (lines[0][17:])
        )
    return lines


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
    shown = [f for f in report.findings if not f.baselined()]
    ordered = sorted(shown, key=lambda f: (_ORDER[f.severity], f.check, f.cause(), f.module or ""))
    out: list[str] = []
    cut = ordered if limit is None else ordered[:limit]
    for f in cut:
        out.extend(_block(f, width, color))
        out.append("")
    if len(ordered) > len(cut):
        rest = len(ordered) - len(cut)
        out.extend(
            _wrap(
                f"... {rest} more finding(s) not shown: see the JSON or HTML report "
                "(gradwatch report FILE --html OUT).",
                width,
                "",
                "    ",
            )
        )
        out.append("")
    out.extend(_paint(line, "2", color) for line in _wrap(coverage_line(report), width, "", "  "))
    out.extend(_summary(report, width, color))
    return "\n".join(out) + "\n"
