"""Sharded engines (FSDP2, FSDP1): local-shard statistics combined with one small collective.

What the mechanisms give us (torch 2.13, gloo, checked on 2 CPU ranks):

- **FSDP2** (``fully_shard``): parameters are ``DTensor`` s holding this rank's shard; their
  post-accumulate-grad hooks fire when FSDP2 assigns the reduce-scattered gradient, and an
  unused parameter's ``.grad`` stays ``None`` on every rank. Arrival evidence is the hooks,
  as without sharding; norms are computed on ``._local_tensor`` and combined across ranks.
- **FSDP1, ``use_orig_params=True``**: each original parameter is a 1-D view of this rank's
  slice of a flat parameter (size 0 on ranks holding none of it). FSDP assigns the gradient
  views after its reduce-scatter, so no hook on an original parameter fires, and an unused
  parameter gets a *zero* slice, not ``None``. A ghost whose module never ran (or ran under
  ``no_grad``) is told by the forward hooks; one whose module ran but gave it no gradient
  cannot be told from a zero gradient. The flat parameters' own hooks mark backward passes.
- **FSDP1 flattened** (default): the model has one ``_flat_param`` per FSDP unit and the
  original modules own no parameter; each original parameter is read from its slice of the
  flat shard, located by the flat parameter's metadata (:mod:`gradwatch.distributed.fsdp1_flat`).
  Ghosts are told by the forward hooks as under ``use_orig_params=True``. A flat parameter
  whose metadata cannot be read is judged whole and a ``not_observed`` error says so.

Statistics never all-gather gradients: each rank sends, per parameter, its shard's sum of
squares, sum of |g|, max |g|, non-zero count, element count and whether it holds a gradient,
riding on the one ``all_gather`` that already carries the arrival codes
(:meth:`gradwatch.distributed.sync.DistSync.exchange`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.measure.stats import Chunk, segment_norms

__all__ = ["combine", "hook_flat_params", "hook_layer_outputs", "local_norms", "payload"]


_F32 = torch.float32


def hook_flat_params(
    flat: Sequence[Callable[[], Optional[torch.Tensor]]],
    add: Callable[[Any], None],
    on_arrival: Callable[[], None],
    on_error: Callable[[str, BaseException], None],
) -> None:
    """FSDP1: a hook on each flat parameter marks the backward passes (``add`` keeps handles).

    No hook on an original parameter fires under FSDP1; the flat parameter is the autograd
    leaf, so its post-accumulate hook runs once per backward.
    """

    def hook(p: torch.Tensor) -> None:
        try:
            on_arrival()
        except Exception as exc:
            on_error("FSDP1 flat parameter hook", exc)

    for ref in flat:
        p = ref()
        if p is not None:
            add(p.register_post_accumulate_grad_hook(hook))


def hook_layer_outputs(
    model: nn.Module,
    add: Callable[[Any], None],
    on_arrival: Callable[[], None],
    on_error: Callable[[str, BaseException], None],
) -> None:
    """FSDP1 watched from inside its wrapper (no flat parameter in reach, e.g. Lightning):
    a gradient reaching any layer's output marks the backward pass instead.

    One tensor hook per layer call under grad mode: the cost is paid under FSDP1 only.
    """

    def grad_hook(grad: torch.Tensor) -> None:
        try:
            on_arrival()
        except Exception as exc:
            on_error("FSDP1 layer output hook", exc)

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        try:
            if not torch.is_grad_enabled():
                return
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(grad_hook)
                    return
        except Exception as exc:
            on_error("FSDP1 layer forward hook", exc)

    for mod in model.modules():
        if mod._parameters:
            add(mod.register_forward_hook(forward_hook))


def local_norms(tensors: Sequence[torch.Tensor], ords: Sequence[float]) -> list[Chunk]:
    """Per-tensor norms of local shards, empty shards included (they give 0).

    ``_foreach_norm`` refuses the max of an empty tensor, and a shard may be empty (a bias
    of 1 element on 2 ranks): one concatenation and a segment reduction handle both.
    """
    if not tensors:
        return [[] for _ in ords]
    flat = torch.cat([t.detach().reshape(-1).to(_F32) for t in tensors])
    return segment_norms(flat, tensors, ords)


def _sq(v: Optional[float]) -> float:
    return 0.0 if v is None else v * v


def payload(
    n: int,
    present: list[bool],
    norms: list[float],
    stats: Optional[dict[str, list[float]]],
    pnorm: list[Optional[float]],
    delta: list[Optional[float]],
    numel: list[int],
) -> list[float]:
    """This rank's per-parameter shard values, laid out for :func:`combine`."""
    nan = math.nan
    out = [1.0 if p else 0.0 for p in present]
    out.extend(v * v for v in norms)
    if stats is not None:
        out.extend(stats["l1"])
        out.extend(stats["linf"])
        out.extend(stats["nnz"])
    out.extend(nan if v is None else v * v for v in pnorm)
    out.extend(nan if v is None else v * v for v in delta)
    out.extend(float(m) for m in numel)
    assert len(out) == n * (5 + (3 if stats is not None else 0))
    return out


def combine(rows: list[list[float]], n: int, observed: bool) -> dict[str, Any]:
    """Every rank's :func:`payload` -> global per-parameter values (same on every rank)."""

    def cols(k: int) -> list[list[float]]:
        return [row[k * n : (k + 1) * n] for row in rows]

    def total(k: int) -> list[float]:
        return [sum(c) for c in zip(*cols(k))]

    has = [any(c) for c in zip(*cols(0))]
    sq = total(1)
    out: dict[str, Any] = {
        "has_grad": has,
        "grad_norm": [math.sqrt(s) if h else None for s, h in zip(sq, has)],
    }
    k = 2
    if observed:
        l1, nnz = total(2), total(4)
        linf = [max(c) for c in zip(*cols(3))]
        out["l1"] = [v if h else None for v, h in zip(l1, has)]
        out["linf"] = [v if h else None for v, h in zip(linf, has)]
        out["nnz"] = [v if h else None for v, h in zip(nnz, has)]
        k = 5
    for key, at in (("param_norm", k), ("delta", k + 1)):
        sums = total(at)  # NaN (no value on some rank) propagates: no value then
        out[key] = [None if math.isnan(s) else math.sqrt(s) for s in sums]
    out["numel"] = [int(v) for v in total(k + 2)]
    return out
