"""One step's gradient reads on this rank's shards (FSDP2, FSDP1), made global in one collective.

:func:`gather_sharded` is :func:`gradwatch.core.gather.gather` for sharded engines: the
same statistics on local pieces (a DTensor's local shard, an FSDP1 original parameter's
view or flat slice), laid out by :func:`gradwatch.distributed.sharded.payload` for the one
``all_gather`` of the step; :func:`merge_shards` turns every rank's rows into the global
values. The update ratio and frozen-parameter checks compare the pieces with copy-free
fingerprints (:mod:`gradwatch.measure.fingerprint`) taken before the step: the squared update
estimates of the pieces add up across ranks to the whole parameter's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Gathered, Track
from gradwatch.distributed.fsdp1_flat import grad_pieces, shard_pieces
from gradwatch.distributed.sharded import combine, local_norms, payload
from gradwatch.measure.fingerprint import Fingerprint, measure
from gradwatch.measure.stats import Chunk, to_host
from gradwatch.model.index import ParamIndex

__all__ = ["gather_sharded", "merge_shards"]


def gather_sharded(
    track: Track,
    t: Tracker,
    ks: list[int],
    ids: list[int],
    arrived: list[bool],
    judged: list[torch.Tensor],
    grads: list[Optional[torch.Tensor]],
    observed: bool,
    scaler_scale: Optional[torch.Tensor],
    extra: Optional[list[torch.Tensor]] = None,
) -> Gathered:
    """:func:`gather` on this rank's shards; :func:`merge_shards` makes the values global."""
    n = len(ids)
    spans = track.flat_spans
    whole = ks is track.positions and track.pieces is not None and len(track.pieces) == n
    lparams = track.pieces if whole else shard_pieces(judged, ids, spans)
    assert lparams is not None
    # A rank holding no gradient for a parameter contributes an empty shard (zero sums).
    lgrads = grad_pieces(grads, ids, spans, lparams)
    present = [g is not None for g in grads]
    ords = (2.0, 1.0, math.inf, 0.0) if observed else (2.0,)
    chunks: list[Chunk] = list(local_norms(lgrads, ords))
    has_delta = False
    if observed:  # norms, and the update estimate from the pre-step fingerprint (no copy)
        has_delta = _measure_into(chunks, lparams, track.fingerprint if whole else None)
    fpieces = track.frozen_pieces
    frozen = (
        track.frozen_ids if observed and fpieces and len(fpieces) == len(track.frozen_ids) else []
    )
    if frozen:
        _frozen_into(chunks, track)
    if scaler_scale is not None:
        chunks.append([scaler_scale])
    n_extra = sum(e.numel() for e in extra) if extra else 0
    if extra:
        chunks.extend(extra)  # the NaN probe's device flags: same transfer
    host = to_host(chunks)
    extra_values = host[len(host) - n_extra :] if n_extra else []
    host = host[: len(host) - n_extra]
    scale = host.pop() if scaler_scale is not None else None
    moved = host[len(host) - len(frozen) :] if frozen else []
    host = host[: len(host) - len(frozen)]
    per = [host[k * n : (k + 1) * n] for k in range(len(host) // n)] if n else []
    norms = per[0] if n else []
    raw: Optional[dict[str, list[float]]] = None
    stats: Optional[dict[str, list[Optional[float]]]] = None
    pnorm: list[Optional[float]] = [None] * n
    delta: list[Optional[float]] = [None] * n
    if observed and n:
        raw = {"l1": per[1], "linf": per[2], "nnz": per[3]}
        stats = {k: [v if h else None for v, h in zip(vs, present)] for k, vs in raw.items()}
        pnorm = list(per[4])
        if has_delta:  # an empty piece moved by nothing; NaN: no estimate for that tensor
            delta = [
                0.0 if lp.numel() == 0 else (None if v != v else v)
                for v, lp in zip(per[5], lparams)
            ]
        stats["param_norm"], stats["delta"] = pnorm, delta
    grad_norm: list[Optional[float]] = [v if h else None for v, h in zip(norms, present)]
    shard = payload(n, present, norms, raw, pnorm, delta, [lp.numel() for lp in lparams])
    shard.extend(0.0 if v != v else v for v in moved)  # NaN (not fingerprinted): no change
    nonfinite = [v is not None and not math.isfinite(v) for v in grad_norm]
    return Gathered(
        ks,
        ids,
        arrived,
        present,
        grad_norm,
        nonfinite,
        [t.last_seq[i] for i in ids] if any(nonfinite) else [],
        [False] * n,
        [False] * n,  # step_without_grad is judged on the global norms in merge_shards
        stats,
        scale,
        grads,
        extra_values,
        shard=shard,
        shard_frozen=list(frozen),
    )


def _measure_into(
    chunks: list[Chunk], pieces: list[torch.Tensor], before: Optional[Fingerprint]
) -> bool:
    """Append the pieces' norms (and update estimates, given ``before``); whether estimated."""
    try:
        try:
            m = measure(pieces, before)
        except ValueError:  # the tracked list changed under the fingerprint
            m = measure(pieces)
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor type it cannot read
        chunks.extend(local_norms(pieces, (2.0,)))
        return False
    chunks.append(m.param_norm)
    if m.delta is None:
        return False
    chunks.append(m.delta)
    return True


def _frozen_into(chunks: list[Chunk], track: Track) -> None:
    """Append one changed flag per frozen parameter (NaN where it cannot tell)."""
    pieces, fp = track.frozen_pieces, track.frozen_fp
    assert pieces is not None
    changed: Optional[torch.Tensor] = None
    if fp is not None:
        try:
            changed = measure(pieces, fp).changed
        except (ValueError, RuntimeError, TypeError, NotImplementedError):
            changed = None
    chunks.append(changed if changed is not None else [torch.tensor(math.nan)] * len(pieces))


def merge_shards(
    g: Gathered,
    rows: list[list[float]],
    observed: bool,
    numel: list[int],
    t: Tracker,
    index: ParamIndex,
) -> None:
    """Make ``g``'s per-rank shard values global (every rank's :func:`payload` rows).

    ``numel`` and the index's sizes become the whole parameters', not this rank's shards.
    """
    n = len(g.ids)
    if g.shard_frozen:  # the frozen parameters' changed flags end each row: any rank moved
        f = len(g.shard_frozen)
        tails = [row[len(row) - f :] for row in rows]
        rows = [row[: len(row) - f] for row in rows]
        g.frozen_changed = [i for i, *vs in zip(g.shard_frozen, *tails) if any(v > 0 for v in vs)]
    if not n:
        return
    c = combine(rows, n, observed and g.stats is not None)
    g.has_grad, g.grad_norm = c["has_grad"], c["grad_norm"]
    if g.stats is not None:
        for key in ("l1", "linf", "nnz", "param_norm", "delta"):
            g.stats[key] = c[key]
    if numel:
        numel[:] = c["numel"]
        for i, m in zip(g.ids, numel):
            index.params[i].numel = m
    g.nonfinite = [v is not None and not math.isfinite(v) for v in g.grad_norm]
    g.order = [t.last_seq[i] for i in g.ids] if any(g.nonfinite) else []
    if any(g.arrived) and all(g.grad_norm[j] in (None, 0.0) for j in range(n) if g.arrived[j]):
        g.cleared = [
            gr is None or t.acc_ref[i]() is not gr or gr._version != t.acc_ver[i]
            for i, gr in zip(g.ids, g.grads)
        ]
