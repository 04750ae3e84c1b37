"""The HTML report's gradient-norm heatmap: every layer's norm history in one chart.

The timeline chart draws a few layers' lines; a model of 100 layers needs all of them at once.
One row per layer (forward order, first on top), one column per recorded step, the colour the
norm on a log scale. NaN/Inf norms are red crosses, exactly-zero norms orange dots, steps a
layer has no sample for are light grey.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from gradwatch.render.html_axes import (
    CHART_WIDTH,
    flagged_layers,
    layer_order,
    layer_ticks,
    legend_above,
    new_figure,
    per_layer_height,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from gradwatch.results import ReportData

__all__ = ["norm_heatmap"]

_MIN_LAYERS = 2  # one layer's history is the timeline chart already


def norm_heatmap(report: ReportData) -> Optional[Figure]:
    """log10 of each layer's gradient norm at each recorded step, as an image.

    Returns ``None`` when fewer than two layers have a history.
    """
    layers = [layer for layer in layer_order(report) if layer.history]
    if len(layers) < _MIN_LAYERS:
        return None
    import numpy as np

    steps = sorted({s for layer in layers for s, _ in layer.history})
    column = {s: k for k, s in enumerate(steps)}
    grid = np.full((len(layers), len(steps)), np.nan)
    bad: list[tuple[int, int]] = []
    zero: list[tuple[int, int]] = []
    for row, layer in enumerate(layers):
        for s, v in layer.history:
            if not math.isfinite(v):
                bad.append((column[s], row))
            elif v == 0.0:
                zero.append((column[s], row))
            else:
                grid[row, column[s]] = math.log10(v)
    fig, ax = new_figure(CHART_WIDTH, per_layer_height(len(layers)))
    ax.set_title("Gradient L2 norm per layer and step (log10)", fontsize=10)
    from matplotlib import colormaps

    cmap = colormaps["viridis"].with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap)
    for points, marker, color, what in (
        (bad, "x", "#c62828", "NaN/Inf norm"),
        (zero, "o", "#ef6c00", "zero norm"),
    ):
        if points:
            ax.scatter(
                [x for x, _ in points],
                [y for _, y in points],
                marker=marker,
                s=12,
                color=color,
                label=what,
                zorder=4,
            )
    layer_ticks(ax, [layer.name for layer in layers], flagged_layers(report))
    shown = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
    ax.set_xticks(shown)
    ax.set_xticklabels([str(steps[k]) for k in shown], fontsize=8)
    ax.set_xlabel("step")
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, aspect=30)
    bar.set_label("log10 gradient L2 norm", fontsize=8)
    legend_above(ax)
    return fig
