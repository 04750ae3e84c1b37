"""What every chart of the HTML report shares: its figure, its layer axis, its markers.

Charts are drawn on ``matplotlib.figure.Figure`` with the Agg canvas, never through
``pyplot``: the report must not open windows, pick a GUI backend, or leave figures in
pyplot's global registry of the user's process.

Every chart accepts NaN/Inf and zero values (a NaN gradient is exactly what a report may
be about): on log axes those are drawn as markers on the axis floor or ceiling
(:func:`mark_missing`). The charts themselves are in :mod:`gradwatch.render.html_plots` and
:mod:`gradwatch.render.html_heatmap`; the layer order and flags serve the layers table too.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from gradwatch._text import safe
from gradwatch.checks.dead import DeadParam
from gradwatch.checks.ghost import GhostParam

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from gradwatch.results import LayerStats, ReportData

__all__ = [
    "AXIS_BOTTOM",
    "AXIS_TOP",
    "BLUE",
    "CHART_WIDTH",
    "LIGHT",
    "ORANGE",
    "RED",
    "chart_label",
    "figure_png",
    "finite_pos",
    "flagged_layers",
    "floor_ceiling",
    "layer_figure",
    "layer_order",
    "layer_ticks",
    "legend_above",
    "mark_missing",
    "new_figure",
    "per_layer_height",
]

_MAX_TICKS = 150  # layer labels on a chart (one per 0.17 in row up to the 26 in cap)
#: Width (inches, at 100 dpi) of every chart: 900 px, shown about 1:1 at 800 and at 1400 px.
CHART_WIDTH = 9.0
#: Axes fractions for markers of values off a log axis (NaN/Inf on top, zero at the bottom).
AXIS_TOP, AXIS_BOTTOM = 0.96, 0.04
_GHOST = GhostParam.id
_DEAD = DeadParam.id
RED, ORANGE, BLUE, LIGHT = "#c62828", "#ef6c00", "#1565c0", "#90caf9"


_LABEL = 60  # characters of a layer name on a chart: a 20,000-character one took seconds


def chart_label(name: str) -> str:
    """A layer name as a chart label: shortened, control bytes shown, ``$`` not mathtext."""
    text = safe(name)
    if len(text) > _LABEL:
        half = (_LABEL - 1) // 2
        text = text[:half] + "\u2026" + text[-half:]
    return text.replace("$", r"\$")


def finite_pos(x: Optional[float]) -> bool:
    """Whether ``x`` can be drawn on a log axis (a finite positive number)."""
    return x is not None and math.isfinite(x) and x > 0


def layer_order(report: ReportData) -> list[LayerStats]:
    """Layers in forward order (first forward call), then those never run in report order."""
    ranked = list(enumerate(report.layers))
    ranked.sort(key=lambda t: (t[1].forward_order is None, t[1].forward_order or 0, t[0]))
    return [layer for _, layer in ranked]


def flagged_layers(report: ReportData) -> dict[str, str]:
    """``{module: "ghost" | "dead"}`` for layers with a ghost/dead finding (ghost wins)."""
    out: dict[str, str] = {}
    for f in report.findings:
        if f.module is None:
            continue
        if f.check == _GHOST:
            out[f.module] = "ghost"
        elif f.check == _DEAD:
            out.setdefault(f.module, "dead")
    return out


def floor_ceiling(values: Sequence[Optional[float]]) -> tuple[float, float]:
    """A log axis's limits: a decade beyond the drawable values (``1e-8..1`` without any)."""
    good = [v for v in values if v is not None and finite_pos(v)]
    if not good:
        return 1e-8, 1.0
    return min(good) / 10.0, max(good) * 10.0


def new_figure(width: float, height: float) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def layer_ticks(ax: Axes, names: list[str], flags: dict[str, str]) -> None:
    """Layer names down the y axis, first layer on top; ghost/dead ones in their colour."""
    n = len(names)
    every = max(1, math.ceil(n / _MAX_TICKS))
    shown = [i for i in range(n) if i % every == 0 or names[i] in flags]
    ax.set_yticks(shown)
    ax.set_yticklabels([chart_label(names[i]) for i in shown], fontsize=7 if n > 120 else 8)
    for label, i in zip(ax.get_yticklabels(), shown):
        kind = flags.get(names[i])
        if kind is not None:
            label.set_color(RED if kind == "ghost" else ORANGE)
            label.set_fontweight("bold")
    ax.set_ylim(n - 0.4, -0.6)
    ax.tick_params(axis="x", labeltop=n > 30)  # a tall chart shows its scale at both ends


def mark_missing(ax: Axes, ys: Sequence[float], x: float, color: str, label: str) -> None:
    """Markers at data ``y`` and axes-fraction ``x`` (values a log axis cannot show)."""
    if ys:
        ax.scatter(
            [x] * len(ys),
            ys,
            marker="x",
            s=30,
            color=color,
            zorder=5,
            label=label,
            transform=ax.get_yaxis_transform(),
            clip_on=False,
        )


def legend_above(ax: Axes) -> None:
    # Above the plot, under the title: a legend inside would hide the markers drawn at the
    # axis edges, and one beside a tall chart is out of sight.
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.figure.legend(
            handles,
            labels,
            loc="outside upper center",
            ncols=min(len(labels), 3),
            fontsize=8,
            frameon=False,
        )


def per_layer_height(n_layers: int) -> float:
    """Figure height (inches) of a chart with one row per layer: 0.17 in a row, 3..26 in all.

    A row stays readable up to about 140 layers; beyond, rows get thinner and the labels are
    thinned (every k-th layer and every flagged one).
    """
    return min(max(3.0, 1.5 + 0.17 * n_layers), 26.0)


def layer_figure(n_layers: int, title: str) -> tuple[Figure, Axes]:
    """A chart of one row per layer, full width, with its title."""
    fig, ax = new_figure(CHART_WIDTH, per_layer_height(n_layers))
    ax.set_title(title, fontsize=10)
    return fig, ax


def figure_png(fig: Any) -> str:
    """The figure as a base64 PNG string (for a ``data:`` URI)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, facecolor="white")
    return base64.b64encode(buf.getvalue()).decode("ascii")
