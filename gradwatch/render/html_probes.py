"""The HTML report's probes section: what ran, its cost and verdict, and two charts.

The overfit curve (``does_not_learn``: the loss on one batch per step, its target, the run at
10 x the learning rate when there was one) and the per-layer derivative agreement
(``gradient_mismatch``: autograd's directional derivative against the finite difference,
one row a layer, mismatches in red). Both are ``None`` when the probe has nothing to draw.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, Callable, Optional

from gradwatch.checks.does_not_learn import DoesNotLearn
from gradwatch.checks.gradient_mismatch import GradientMismatch
from gradwatch.render.html_axes import (
    BLUE,
    CHART_WIDTH,
    ORANGE,
    RED,
    chart_label,
    figure_png,
    layer_figure,
    legend_above,
    new_figure,
)
from gradwatch.results import ProbeResult, ReportData

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["agreement_chart", "overfit_chart", "probes_section"]

_OVERFIT = DoesNotLearn.id
_GRADIENT = GradientMismatch.id
_COLORS = {"agree": BLUE, "mismatch": RED, "explained": ORANGE, "inconclusive": "#999999"}


def _record(report: ReportData, probe_id: str) -> Optional[ProbeResult]:
    return next((p for p in report.probes if p.id == probe_id), None)


def overfit_chart(report: ReportData) -> Optional[Figure]:
    """The loss on the one batch, step by step, against the target it had to reach."""
    rec = _record(report, _OVERFIT)
    if rec is None or not rec.curve:
        return None
    fig, ax = new_figure(CHART_WIDTH, 3.2)
    ax.plot(range(len(rec.curve)), rec.curve, color=BLUE, label="loss, the user's learning rate")
    boosted = rec.details.get("curve_at_10x_lr") or []
    if boosted:
        ax.plot(range(len(boosted)), boosted, color=ORANGE, label="loss at 10 x the rate")
    target = rec.details.get("target")
    if isinstance(target, (int, float)) and math.isfinite(target):
        ax.axhline(target, color=RED, linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("step on one fixed batch")
    ax.set_ylabel("loss")
    ax.set_title("Overfit one batch (does_not_learn)", fontsize=10)
    legend_above(ax)
    return fig


def agreement_chart(report: ReportData) -> Optional[Figure]:
    """Per layer: the relative difference of autograd and the finite difference (log axis)."""
    rec = _record(report, _GRADIENT)
    if rec is None or not rec.layers:
        return None
    rows = rec.layers
    fig, ax = layer_figure(len(rows), "Derivative agreement per layer (gradient_mismatch)")
    errors = [max(r.error, 1e-16) if math.isfinite(r.error) else 1.0 for r in rows]
    for status, color in _COLORS.items():
        ys = [y for y, r in enumerate(rows) if r.status == status]
        if ys:
            ax.barh(ys, [errors[y] for y in ys], left=1e-17, height=0.6, color=color, label=status)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([chart_label(r.name) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("|numeric - autograd| / max(|numeric|, |autograd|)")
    legend_above(ax)
    return fig


def _chart(title: str, build: Callable[[ReportData], Any], report: ReportData) -> str:
    try:
        fig = build(report)
    except Exception as exc:  # one broken chart must not cost the whole report
        return f'<p class="empty">{html.escape(title)}: chart failed: {html.escape(repr(exc))}</p>'
    if fig is None:
        return ""
    return (
        f'<div class="chart-box"><img class="chart" alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{figure_png(fig)}"></div>'
    )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def probes_section(report: ReportData) -> str:
    """The section: a table of the probes (verdict, seconds, copy size, note) and charts."""
    if not report.probes:
        return ""
    rows = []
    for p in report.probes:
        note = p.note + (" (sampled)" if p.sampled and "sampled" not in p.note else "")
        rows.append(
            f"<tr><td><code>{html.escape(p.id)}</code></td><td>{html.escape(p.verdict)}</td>"
            f'<td class="num">{p.seconds:.2f} s</td>'
            f'<td class="num">{_size(p.memory_bytes)}</td>'
            f"<td>{html.escape(note)}</td></tr>"
        )
    table = (
        '<div class="scroll"><table class="layers"><tr><th>probe</th><th>verdict</th>'
        "<th>time</th><th>copy</th><th>note</th></tr>" + "".join(rows) + "</table></div>"
    )
    charts = _chart("Overfit one batch", overfit_chart, report) + _chart(
        "Derivative agreement", agreement_chart, report
    )
    return "<h2>Probes (on a copy of the model)</h2>" + table + charts
