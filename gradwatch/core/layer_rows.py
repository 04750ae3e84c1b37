"""The per-layer aggregation of an observed step, fast path for the usual case.

:func:`gradwatch.core.gather.layer_samples` filters every layer's positions (arrived,
present, measured) on each statistics step. In the usual step every tracked parameter
arrived, has a gradient and was measured: then the filters keep everything, and each
layer's values are read with a cached :func:`operator.itemgetter` (one C call per
statistic and layer instead of a comprehension). Same arithmetic, same results.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, Callable, Optional

from gradwatch.checks.views import LayerSample

__all__ = ["fast_layer_samples"]

_Getter = Callable[[Any], tuple[Any, ...]]
# id(track.layer_positions) -> (that dict, its rows); set_params replaces the dict.
_ROWS: dict[int, tuple[dict[str, list[int]], list[tuple[str, list[int], _Getter]]]] = {}


def _getter(js: list[int]) -> _Getter:
    if len(js) > 1:
        return itemgetter(*js)  # type: ignore[return-value]
    (j,) = js
    return lambda seq: (seq[j],)


def _rows(groups: dict[str, list[int]]) -> list[tuple[str, list[int], _Getter]]:
    found = _ROWS.get(id(groups))
    if found is None or found[0] is not groups:
        if len(_ROWS) > 64:  # bounded: a few layouts per process
            _ROWS.clear()
        found = _ROWS[id(groups)] = (groups, [(k, js, _getter(js)) for k, js in groups.items()])
    return found[1]


def fast_layer_samples(
    stats: dict[str, list[Optional[float]]],
    arrived: list[bool],
    gn: list[Optional[float]],
    numel: list[int],
    groups: dict[str, list[int]],
) -> Optional[dict[str, LayerSample]]:
    """Per-layer samples when every position is live and measured; None otherwise.

    ``groups`` maps each layer to its positions (every tracked parameter judged this step).
    """
    l1, linf, nnz = stats.get("l1"), stats.get("linf"), stats.get("nnz")
    pnorm, delta = stats["param_norm"], stats["delta"]
    if l1 is None or linf is None or nnz is None or False in arrived or None in gn:
        return None
    if None in pnorm:
        return None
    no_delta = all(d is None for d in delta)
    if not no_delta and None in delta:
        return None
    hypot = math.hypot
    out: dict[str, LayerSample] = {}
    for layer, js, get in _rows(groups):
        size = sum(get(numel)) or 1
        out[layer] = LayerSample(
            positions=js,
            norm=hypot(*get(gn)),
            mean_abs=sum(get(l1)) / size,
            max_abs=max(get(linf)),
            nonzero=sum(get(nnz)),
            numel=size,
            param_norm=hypot(*get(pnorm)),
            delta_norm=None if no_delta else hypot(*get(delta)),
        )
    return out
