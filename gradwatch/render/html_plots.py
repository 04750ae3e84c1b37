"""The HTML report's charts: matplotlib ``Figure`` objects built from a report.

One function per chart, each ``None`` when the report has nothing to draw. What they share
(the Agg figure, never ``pyplot``; the layer axis; markers for NaN/Inf and zero values a log
axis cannot show; the PNG encoding) is in :mod:`gradwatch.render.html_axes`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from gradwatch.render.html_axes import (
    AXIS_BOTTOM,
    AXIS_TOP,
    BLUE,
    CHART_WIDTH,
    LIGHT,
    ORANGE,
    RED,
    chart_label,
    finite_pos,
    flagged_layers,
    floor_ceiling,
    layer_figure,
    layer_order,
    layer_ticks,
    legend_above,
    mark_missing,
    new_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from gradwatch.results import LayerStats, ReportData

__all__ = [
    "UPDATE_RATIO_RULE",
    "curvature_bars",
    "gradient_flow",
    "norm_timelines",
    "update_ratios",
]

#: |Δw|/|w| per step around 1e-3 is the usual rule of thumb for a healthy learning rate.
UPDATE_RATIO_RULE = 1e-3
#: Layers drawn in the timeline chart besides the flagged ones.
TOP_K = 8


def gradient_flow(report: ReportData) -> Optional[Figure]:
    """Per-layer mean and max |grad| in forward order on a log axis; ghost/dead layers marked.

    One row per layer (first layer on top), so the chart grows with the model instead of
    squeezing it. Returns ``None`` when the report has no layers.
    """
    layers = layer_order(report)
    if not layers:
        return None
    flags = flagged_layers(report)
    names = [layer.name for layer in layers]
    mean = [layer.mean_abs_grad for layer in layers]
    peak = [layer.max_abs_grad for layer in layers]
    floor, ceiling = floor_ceiling(mean + peak)
    fig, ax = layer_figure(len(layers), "Gradient flow (layers in forward order)")
    ys = list(range(len(layers)))

    def bars(values: list[Optional[float]]) -> list[float]:
        return [v - floor if v is not None and finite_pos(v) else 0.0 for v in values]

    ax.barh(ys, bars(peak), left=floor, height=0.8, color=LIGHT, label="max |grad|")
    ax.barh(ys, bars(mean), left=floor, height=0.5, color=BLUE, label="mean |grad|")
    ax.set_xscale("log")
    ax.set_xlim(floor, ceiling)
    nonfinite = [
        y
        for y, v, p in zip(ys, mean, peak)
        if any(u is not None and not math.isfinite(u) for u in (v, p))
    ]
    zero = [y for y, v in zip(ys, mean) if v is not None and v == 0.0 and y not in nonfinite]
    absent = [y for y, v in zip(ys, mean) if v is None]
    mark_missing(ax, nonfinite, AXIS_TOP, RED, "NaN/Inf")
    mark_missing(ax, zero, AXIS_BOTTOM, ORANGE, "exactly zero")
    mark_missing(ax, absent, AXIS_BOTTOM, "#757575", "no gradient")
    for kind, color in (("ghost", RED), ("dead", ORANGE)):
        marked = [y for y, name in zip(ys, names) if flags.get(name) == kind]
        for y in marked:
            ax.axhspan(y - 0.45, y + 0.45, color=color, alpha=0.12, lw=0)
            ax.text(
                0.99,
                y,
                kind,
                transform=ax.get_yaxis_transform(),
                ha="right",
                va="center",
                fontsize=7,
                color=color,
                fontweight="bold",
            )
        if marked:
            ax.scatter([], [], marker="s", color=color, alpha=0.3, label=f"{kind} layer")
    layer_ticks(ax, names, flags)
    ax.set_xlabel("|gradient| (log)")
    ax.set_axisbelow(True)  # grid lines behind the bars
    ax.grid(axis="x", which="major", alpha=0.3)
    legend_above(ax)
    return fig


def _timeline_layers(report: ReportData, k: int) -> list[LayerStats]:
    flags = flagged_layers(report)
    flagged_modules = {f.module for f in report.findings if f.module is not None} | set(flags)
    with_history = [layer for layer in report.layers if layer.history]

    def peak(layer: LayerStats) -> float:
        finite = [v for _, v in layer.history if math.isfinite(v)]
        if len(finite) < len(layer.history):
            return math.inf  # non-finite norms: always worth a line
        return max(finite, default=0.0)

    ranked = sorted(with_history, key=peak, reverse=True)
    flagged = [layer for layer in ranked if layer.name in flagged_modules]
    # Every flagged layer up to 2k lines (a legend of 90 lines reads as none: the heatmap
    # shows them all).
    chosen = {layer.name for layer in ranked[:k]} | {layer.name for layer in flagged[: 2 * k]}
    return [layer for layer in layer_order(report) if layer.name in chosen]


def norm_timelines(report: ReportData, k: int = TOP_K) -> Optional[Figure]:
    """Gradient-norm history of the top-``k`` layers by norm plus every flagged layer.

    Returns ``None`` when no layer has a history.
    """
    layers = _timeline_layers(report, k)
    if not layers:
        return None
    values = [v for layer in layers for _, v in layer.history]
    floor, ceiling = floor_ceiling(values)
    fig, ax = new_figure(CHART_WIDTH, 4.6)
    flagged_modules = {f.module for f in report.findings if f.module is not None}
    bad_x: list[int] = []
    zero_x: list[int] = []
    for layer in layers:
        steps = [s for s, v in layer.history if finite_pos(v)]
        norms = [v for _, v in layer.history if finite_pos(v)]
        bad_x += [s for s, v in layer.history if not math.isfinite(v)]
        zero_x += [s for s, v in layer.history if v == 0.0]
        style = "--" if layer.name in flagged_modules else "-"
        label = chart_label(layer.name) + (" (flagged)" if layer.name in flagged_modules else "")
        ax.plot(steps, norms, style, marker="." if len(steps) < 40 else None, lw=1.3, label=label)
    ax.set_yscale("log")
    ax.set_ylim(floor, ceiling)
    for xs, y, color, what in (
        (bad_x, AXIS_TOP, RED, "NaN/Inf norm"),
        (zero_x, AXIS_BOTTOM, ORANGE, "zero norm"),
    ):
        if xs:
            ax.scatter(
                sorted(set(xs)),
                [y] * len(set(xs)),
                marker="x",
                s=40,
                color=color,
                zorder=5,
                label=what,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
            )
    from matplotlib.ticker import MaxNLocator

    all_steps = [s for layer in layers for s, _ in layer.history]
    pad = max(0.5, 0.02 * (max(all_steps) - min(all_steps)))
    ax.set_xlim(min(all_steps) - pad, max(all_steps) + pad)  # markers do not autoscale x
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("gradient L2 norm (log)")
    ax.set_title(f"Gradient norm per layer (top {k} by norm + flagged)")
    ax.grid(alpha=0.3)
    # Beside the plot: one entry per line, which reads down a column.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def update_ratios(report: ReportData) -> Optional[Figure]:
    """|Δw|/|w| of the last step per layer against the 1e-3 rule of thumb, one row a layer.

    Points outside the 1e-4..1e-2 band are orange (a learning rate far too high or too low
    there). Returns ``None`` when the report has no layers.
    """
    layers = layer_order(report)
    if not layers:
        return None
    flags = flagged_layers(report)
    names = [layer.name for layer in layers]
    ratios = [layer.update_ratio for layer in layers]
    floor, ceiling = floor_ceiling([*ratios, UPDATE_RATIO_RULE])
    fig, ax = layer_figure(len(layers), "Update ratio per layer |Δw| / |w| (last step)")
    low, high = UPDATE_RATIO_RULE / 10, UPDATE_RATIO_RULE * 10
    good = [(y, r) for y, r in enumerate(ratios) if r is not None and finite_pos(r)]
    inside = [(y, r) for y, r in good if low <= r <= high]
    outside = [(y, r) for y, r in good if not low <= r <= high]
    for points, color, what in (
        (inside, BLUE, "within 1e-4 .. 1e-2"),
        (outside, ORANGE, "outside 1e-4 .. 1e-2 (lr too high or too low)"),
    ):
        if points:
            ax.scatter(
                [r for _, r in points],
                [y for y, _ in points],
                s=30,
                color=color,
                zorder=4,
                label=what,
            )
    ax.set_xscale("log")
    ax.set_xlim(floor, ceiling)
    ax.axvline(UPDATE_RATIO_RULE, color="#555", ls="--", lw=1, label="1e-3 rule of thumb")
    ax.axvspan(low, high, color="#a5d6a7", alpha=0.2, lw=0)
    ys = range(len(layers))
    missing = [y for y, r in zip(ys, ratios) if r is None or r == 0.0]
    bad = [y for y, r in zip(ys, ratios) if r is not None and not math.isfinite(r)]
    mark_missing(ax, missing, AXIS_BOTTOM, "#757575", "no update measured / zero")
    mark_missing(ax, bad, AXIS_TOP, RED, "NaN/Inf")
    layer_ticks(ax, names, flags)
    ax.set_xlabel("update ratio (log; green band: 1e-4 .. 1e-2)")
    ax.grid(axis="x", alpha=0.3)
    legend_above(ax)
    return fig


def curvature_bars(report: ReportData) -> Optional[Figure]:
    """Per-layer Hessian trace per parameter (bars, ± standard error) and top eigenvalue.

    Both on log axes by magnitude, one row a layer; negative traces (non-convex directions)
    in orange. Returns ``None`` when the report has no curvature.
    """
    if report.curvature is None or not report.curvature.layers:
        return None
    rows = report.curvature.layers
    names = [c.name for c in rows]
    per = [abs(c.trace_per_param) for c in rows]
    err = [c.trace_stderr / c.numel if c.numel else 0.0 for c in rows]
    eig = [abs(c.top_eigenvalue) for c in rows]
    floor, ceiling = floor_ceiling([*per, *eig])
    fig, ax = layer_figure(len(rows), "Curvature per layer (Hessian blocks)")
    ys = range(len(rows))
    ok = [y for y in ys if finite_pos(per[y])]
    for sign, color, what in (
        (1, BLUE, "|trace| / numel (± std. error)"),
        (-1, ORANGE, "negative trace: |trace| / numel"),
    ):
        chosen = [y for y in ok if (rows[y].trace_per_param > 0) == (sign > 0)]
        if chosen:
            ax.barh(
                chosen,
                [per[y] - floor for y in chosen],
                left=floor,
                height=0.6,
                color=color,
                xerr=[min(err[y], per[y] - floor) for y in chosen],
                capsize=2,
                label=what,
            )
    good = [y for y in ys if finite_pos(eig[y])]
    ax.scatter(
        [eig[y] for y in good],
        good,
        marker="D",
        s=24,
        color=RED,
        zorder=4,
        label="|top eigenvalue|",
    )
    ax.set_xscale("log")
    ax.set_xlim(floor, ceiling)
    layer_ticks(ax, names, {})
    ax.set_xlabel("curvature (log)")
    ax.grid(axis="x", alpha=0.3)
    legend_above(ax)
    return fig
