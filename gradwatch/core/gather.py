"""One step's decision inputs: gradients gathered, norms computed on device, one host transfer."""

from __future__ import annotations

import math
from collections.abc import Mapping
from operator import attrgetter
from typing import Callable, Optional

import torch

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.step_reading import ReadGrads
from gradwatch.capture.grads.window import Gathered, Track
from gradwatch.checks.views import LayerSample, LayerTable
from gradwatch.core.layers import folded_samples
from gradwatch.distributed.gather import gather_sharded
from gradwatch.measure import columns
from gradwatch.measure.columns import layout
from gradwatch.measure.fingerprint import Measured, measure
from gradwatch.measure.stats import Chunk, to_host
from gradwatch.measure.stats import norms as vector_norms
from gradwatch.model.index import ParamIndex

_requires_grad = attrgetter("requires_grad")


def _spread(ks_present: list[int], values: list[float], n: int) -> list[Optional[float]]:
    if len(ks_present) == n:  # every position present (the usual case): already aligned
        return values  # type: ignore[return-value]
    out: list[Optional[float]] = [None] * n
    for k, v in zip(ks_present, values):
        out[k] = v
    return out


def _judged(
    track: Track, min_hooked_at: dict[int, int], last_hooked: int
) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """Positions judged this step: one frozen since, or hooked during this window, is not."""
    start, params = track.start, track.params
    if last_hooked <= start and all(map(_requires_grad, params)):
        return track.positions, track.ids, params  # the usual step: the track's own lists
    ks = [
        k
        for k, (i, p) in enumerate(zip(track.ids, params))
        if p.requires_grad and min_hooked_at.get(i, 0) <= start
    ]
    return ks, [track.ids[k] for k in ks], [params[k] for k in ks]


def _observed_chunks(
    track: Track,
    ks: list[int],
    judged: list[torch.Tensor],
    grad_stats: list[Chunk],
    chunks: list[Chunk],
) -> tuple[int, list[int], bool, Optional[Measured]]:
    """Queue gradient statistics, parameter norms, then the update (no parameter copy).

    Returns (statistics per gradient, measured positions, has update, the measurement).
    """
    chunks.extend(grad_stats)
    n_stats = len(grad_stats)
    n = len(judged)
    if ParamIndex.any_uninitialized(judged):
        pnorm_ks = [j for j in range(n) if not ParamIndex.uninitialized(judged[j])]
    else:
        pnorm_ks = list(range(n))
    ps = judged if len(pnorm_ks) == n else [judged[j] for j in pnorm_ks]
    if not ps:
        return n_stats, pnorm_ks, False, None
    fp = track.fingerprint
    whole = fp is not None and ks is track.positions and len(ps) == n
    # the track's own list: its small tensors' reading may serve the next step's fingerprint
    step = track.steps if ps is track.params else None
    try:
        try:
            m = measure(ps, fp if whole else None, step)
        except ValueError:  # the tracked list changed under the fingerprint
            m = measure(ps)
        chunks.append(m.param_norm)
        if m.delta is not None:
            chunks.append(m.delta)
            chunks.append(m.moved_frac if m.moved_frac is not None else m.delta * float("nan"))
            return n_stats, pnorm_ks, True, m
        return n_stats, pnorm_ks, False, m
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor type it cannot
        chunks.append(vector_norms(ps, (2.0,))[0])  # read: norms only, no update
    return n_stats, pnorm_ks, False, None


def _observed(
    track: Track,
    ks: list[int],
    judged: list[torch.Tensor],
    grad_chunks: list[Chunk],
    chunks: list[Chunk],
    live: bool,
) -> tuple[tuple[int, list[int], bool], Optional[torch.Tensor]]:
    """Queue an observed step's statistics; fold them per layer where every position is
    ``live`` (arrived, with a gradient) and measured. ``grad_chunks``: empty without any
    gradient."""
    n_stats, pnorm_ks, has_delta, m = _observed_chunks(track, ks, judged, grad_chunks[1:], chunks)
    folded = None
    if live and len(pnorm_ks) == len(judged):
        folded = _fold_chunk(track, grad_chunks, m)
    return (n_stats, pnorm_ks, has_delta), folded


def _fold_chunk(
    track: Track, grad_chunks: list[Chunk], m: Optional[Measured]
) -> Optional[torch.Tensor]:
    """The per-layer columns of an observed step where every position is live and measured
    (measure/columns.py); None where the per-parameter values are folded on the host."""
    if m is None or len(grad_chunks) != 4:
        return None
    parts = [*grad_chunks, m.param_norm, m.delta]
    if not all(isinstance(x, torch.Tensor) for x in parts[:5]):
        return None  # per-tensor lists (several devices): the host folds them
    try:
        return columns.fold(layout(track.layer_positions), *parts)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, IndexError):  # mixed devices or an unexpected layout
        return None


def _frozen_chunk(track: Track, chunks: list[Chunk]) -> int:
    """Queue whether frozen parameters an optimizer holds moved; returns how many values."""
    if track.frozen_fp is None:
        return 0
    try:
        frozen_changed = measure(track.frozen, track.frozen_fp).changed
    except (ValueError, RuntimeError, TypeError, NotImplementedError):
        return 0
    if frozen_changed is None:
        return 0
    chunks.append(frozen_changed)
    return len(track.frozen)


def _read_back(
    host: list[float],
    present: list[int],
    n: int,
    n_grads: int,
    n_pending: int,
    observed: Optional[tuple[int, list[int], bool]],
    n_frozen: int,
    n_extra: int,
    has_scale: bool,
) -> tuple[
    list[Optional[float]],
    list[float],
    Optional[dict[str, list[Optional[float]]]],
    list[float],
    Optional[float],
    list[float],
]:
    """Slice the host values in the order ``gather`` queued them, aligned to the judged positions.

    ``observed`` is ``(statistics per gradient, measured positions, has update)``; returns
    the norms, pending flags, statistics, frozen moves, scaler scale and extra values.
    """
    norms = _spread(present, host[:n_grads], n)
    pos = n_grads + n_pending
    flags = host[n_grads:pos]
    stats: Optional[dict[str, list[Optional[float]]]] = None
    if observed is not None:
        n_stats, pnorm_ks, has_delta = observed
        stats = {}
        for key in ("l1", "linf", "nnz")[:n_stats]:
            stats[key] = _spread(present, host[pos : pos + n_grads], n)
            pos += n_grads
        m = len(pnorm_ks)
        stats["param_norm"] = _spread(pnorm_ks, host[pos : pos + m], n)
        pos += m
        if has_delta:  # NaN: a tensor the fingerprint could not cover (no estimate)
            delta = [None if v != v else v for v in host[pos : pos + m]]
            stats["delta"] = _spread(pnorm_ks, delta, n)  # type: ignore[arg-type]
            pos += m
            frac = [None if v != v else v for v in host[pos : pos + m]]
            stats["moved_frac"] = _spread(pnorm_ks, frac, n)  # type: ignore[arg-type]
            pos += m
        else:
            stats["delta"] = [None] * n
    moved = host[pos : pos + n_frozen]
    pos += n_frozen
    scale = None
    if has_scale:
        scale = host[pos]
        pos += 1
    return norms, flags, stats, moved, scale, host[pos : pos + n_extra]


def _nonfinite(
    norms: list[Optional[float]], grads: list[Optional[torch.Tensor]], ids: list[int], t: Tracker
) -> tuple[list[bool], list[int]]:
    """NaN/Inf norms (an inf L2 norm may be float32 overflow: rechecked) and arrival order."""
    isfinite = math.isfinite
    nonfinite = [v is not None and not isfinite(v) for v in norms]
    if not any(nonfinite):
        return nonfinite, []
    for j, (v, g) in enumerate(zip(norms, grads)):
        if nonfinite[j] and g is not None and v is not None and math.isinf(v):
            dense = g.coalesce()._values() if g.is_sparse else g
            nonfinite[j] = not bool(torch.isfinite(dense).all())
    ls = t.last_seq
    return nonfinite, [ls[i] for i in ids]


def _cleared(
    t: Tracker,
    ids: list[int],
    arrived: list[bool],
    norms: list[Optional[float]],
    grads: list[Optional[torch.Tensor]],
) -> list[bool]:
    """step_without_grad evidence: only when no arrived gradient is left with a non-zero value."""
    if any(arrived) and all(norms[j] in (None, 0.0) for j in range(len(ids)) if arrived[j]):
        return [
            g is None or t.acc_ref[i]() is not g or g._version != t.acc_ver[i]
            for i, g in zip(ids, grads)
        ]
    return [False] * len(ids)


def gather(
    track: Track,
    tracker: Tracker,
    *,
    observed: bool,
    min_hooked_at: dict[int, int],
    last_hooked: int,
    scaler_scale: Optional[torch.Tensor],
    extra: Optional[list[torch.Tensor]] = None,
    arrival: Optional[Callable[[int], bool]] = None,
    read: Optional[ReadGrads] = None,
) -> Gathered:
    """Read this step's gradients and compute what the checks need, with one host transfer.

    Hot path: list comprehensions over the track's parameters, no per-parameter function
    calls; the per-parameter lists are only built in full where a check can use them.
    ``arrival`` replaces the hooks' evidence where they cannot see gradients (FSDP1);
    ``read``, the step reading's (parameters, ``.grad`` list), spares a second read of each.
    """
    t, params = tracker, track.params
    ks, ids, judged = _judged(track, min_hooked_at, last_hooked)
    n = len(ids)
    arrived = t.count_arrivals(ids, track.start, arrival)
    grads = read[1] if read is not None and read[0] is judged else [p.grad for p in judged]
    if track.sharded is not None:
        return gather_sharded(
            track, t, ks, ids, arrived, judged, grads, observed, scaler_scale, extra
        )
    present = [j for j, g in enumerate(grads) if g is not None]
    pg = grads if len(present) == n else [grads[j] for j in present]
    ords = (2.0, 1.0, math.inf, 0.0) if observed else (2.0,)
    # Every gradient present: their shapes are the parameters' (autograd enforces it), so the
    # parameter list's identity keys their grouping by shape (measure/chunked.py).
    layout = id(params) if pg is grads and judged is params else None
    grad_chunks = vector_norms(pg, ords, layout)  # type: ignore[arg-type]
    # The transfer's order, read back below: norms, pending flags, statistics, parameter
    # norms, update, frozen moves, scaler scale, extra evidence.
    chunks: list[Chunk] = [grad_chunks[0]]
    pending: list[int] = []
    if t.pending:
        pending = [j for j in range(n) if arrived[j] and ids[j] in t.pending]
        chunks.append([t.dirty[ids[j]] for j in pending])
    queued, folded = None, None  # observed: (statistics per gradient, measured, has update)
    if observed:
        live = pg is grads and ks is track.positions and False not in arrived
        queued, folded = _observed(track, ks, judged, grad_chunks if pg else [], chunks, live)
    n_frozen = _frozen_chunk(track, chunks)
    if scaler_scale is not None:
        chunks.append([scaler_scale])
    if extra:
        chunks.extend(extra)  # device flags of other evidence (the NaN probe): same transfer
    if folded is not None:
        chunks.append(folded)  # last: the per-layer columns
    host = to_host(chunks)
    n_extra = sum(x.numel() for x in extra) if extra else 0
    norms, flags, stats, moved, scale, extra_values = _read_back(
        host,
        present,
        n,
        len(pg),
        len(pending),
        queued,
        n_frozen,
        n_extra,
        scaler_scale is not None,
    )
    frozen_changed_ids = [i for i, v in zip(track.frozen_ids, moved) if v > 0]

    # missing_zero_grad: a value check said the gradient held pre-step contributions.
    dirty = [False] * n
    for j, flag in zip(pending, flags):
        dirty[j] = bool(flag) and grads[j] is not None
    nonfinite, order = _nonfinite(norms, grads, ids, t)
    return Gathered(
        ks,
        ids,
        arrived,
        [g is not None for g in grads],
        norms,
        nonfinite,
        order,
        dirty,
        _cleared(t, ids, arrived, norms, grads),
        stats,
        scale,
        grads,
        extra_values,
        frozen_changed_ids,
        folded=host[-folded.numel() :] if folded is not None else None,
    )


def layer_samples(g: Gathered, numel: list[int], track: Track) -> Mapping[str, LayerSample]:
    """Per-layer values over the parameters that received a gradient (observed steps only)."""
    if g.stats is None:
        return {}
    if (  # every position live, measured and finite (the usual step): folded on the device
        g.folded is not None
        and g.ks is track.positions
        and False not in g.arrived
        and not any(g.nonfinite)
    ):
        return folded_samples(g.folded, layout(track.layer_positions), numel)
    l1, linf, nnz = g.stats.get("l1"), g.stats.get("linf"), g.stats.get("nnz")
    pnorm, delta = g.stats["param_norm"], g.stats["delta"]
    if g.ks is track.positions:  # every tracked parameter judged: the cached grouping holds
        groups = track.layer_positions
    else:
        groups = {}
        for j, k in enumerate(g.ks):
            groups.setdefault(track.layer_of[k], []).append(j)
    out: dict[str, LayerSample] = {}
    if l1 is None or linf is None or nnz is None:
        return out
    arrived, gn = g.arrived, g.grad_norm
    hypot = math.hypot
    for layer, js in groups.items():
        live = [j for j in js if arrived[j] and gn[j] is not None]
        if not live:
            continue
        pn = [pnorm[j] for j in js if pnorm[j] is not None]
        dn = [delta[j] for j in js if delta[j] is not None]
        maxes = [v for v in (linf[j] for j in live) if v is not None]
        size = sum([numel[j] for j in live]) or 1
        out[layer] = LayerSample(
            positions=live,
            norm=hypot(*[gn[j] for j in live]),  # type: ignore[arg-type]
            mean_abs=sum([l1[j] for j in live]) / size,  # type: ignore[misc]
            max_abs=max(maxes),
            nonzero=sum([nnz[j] for j in live]),  # type: ignore[misc]
            numel=size,
            param_norm=hypot(*pn) if pn else None,  # type: ignore[arg-type]
            delta_norm=hypot(*dn) if len(dn) == len(js) else None,  # type: ignore[arg-type]
        )
    return LayerTable.of(out)  # columns built once, not by each check that reads them
