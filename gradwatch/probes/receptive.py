"""The ``dependence_outside_receptive_field`` probe: does an output position depend on input
positions that no layer of the model can connect?

One forward of a copy (batch norms in eval mode: in train mode their statistics couple every
position; dropout off) under :class:`~gradwatch.probes._reach_ops.OpLog` reads the receptive
field its ops make along the positions: bounded for convolutions, local pooling and pointwise
layers, every position for attention, recurrence, global pooling and the other reach-all ops
(and for modules of those kinds in the module graph). When the field is bounded and smaller
than the axis, a few output positions spread along each position axis (the output's axes
beside the batch and the channels, paired with the input's of the same index) are
differentiated, each by one backward from a random weighting of that slice of one sample's
output: the gradient on input positions outside the field, beyond ``min_share`` of the
gradient inside it, is a dependence no layer made. The reshape that regrouped dimensions
(``x.view(B, L, C)`` of a ``(B, C, L)`` tensor) is named with its line.

What it cannot judge: any model with an op that reaches every position (every transformer,
recurrent net, global pooling, group norm): a scramble before such an op is invisible to a
dependence map (``sample_dependence``'s causal and padding rules see some of those); an
output without a position axis of the input's (a classifier); axes whose size equals a
channel count the layers read (they might be channels); a field that covers the axis. An
op the log does not know is taken as pointwise: a dependence it makes is reported as a
``warning`` when no regrouping reshape explains it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradwatch.probes._copies import own_bytes, shared_copy
from gradwatch.probes._reach_ops import OpLog, Reshape
from gradwatch.probes._replay import Draws
from gradwatch.probes._sandbox import Budget, CannotJudge, LossFn, batch_size
from gradwatch.probes.positions import weighted_grads
from gradwatch.probes.samples import _forward as forward_with_leaves

__all__ = ["FieldResult", "Outreach", "receptive_field"]

_REACH_ALL_MODULES = (
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.GroupNorm,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
_REACH_ALL_NAME = re.compile(
    r"Attention|Attn|Mamba|SSM|RNN|LSTM|GRU|Transformer|NonLocal|Rwkv|Retention|Hyena|Recurren",
    re.I,
)


@dataclass
class Outreach:
    """An output position whose gradient reaches input positions outside its field."""

    axis: int
    position: int
    window: tuple[int, int]  # the input positions its field allows
    reached: list[int]  # input positions outside it that its gradient reaches
    share: float
    input: str


@dataclass
class FieldResult:
    """The field the ops make, what was measured, and what was not judged (and why)."""

    sample: int = 0
    field_size: float = 0.0
    reach_all: list[str] = field(default_factory=list)
    axes: list[int] = field(default_factory=list)  # the output axes measured
    outreach: Optional[Outreach] = None
    reshape: Optional[Reshape] = None  # the regrouping reshape, when one ran
    not_judged: dict[str, str] = field(default_factory=dict)
    reason: str = ""  # why nothing was judged: no_position_axis, reaches_every_position,
    # field_covers_axis
    memory_bytes: int = 0


def _module_reach_all(model: nn.Module) -> list[str]:
    found = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        wide_norm = isinstance(mod, nn.LayerNorm) and len(mod.normalized_shape) > 1
        inorm = isinstance(mod, nn.modules.instancenorm._InstanceNorm)
        if isinstance(mod, _REACH_ALL_MODULES) or inorm or wide_norm:
            found.append(f"{kind} at {name or 'the root'}")
        elif _REACH_ALL_NAME.search(kind) and next(mod.parameters(), None) is not None:
            found.append(f"{kind} at {name or 'the root'}")
        if len(found) >= 4:
            break
    return found


def _forward(copy: nn.Module, batch: Any, loss_fn: LossFn, n: int, log: OpLog) -> Any:
    """The copy's forward with ``log`` entered around the model's own forward only."""
    active: list[bool] = []

    def enter(module: nn.Module, args: Any) -> None:
        if not active:
            log.__enter__()
            active.append(True)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if active:
            log.__exit__(None, None, None)
            active.clear()

    handles = [copy.register_forward_pre_hook(enter), copy.register_forward_hook(leave)]
    try:
        with Draws(n):
            return forward_with_leaves(copy, batch, loss_fn, n)
    finally:
        if active:
            log.__exit__(None, None, None)
        for h in handles:
            h.remove()


def _position_axes(out: Tensor, leaf: Tensor, channels: set[int]) -> list[int]:
    """The axes beside the batch that hold positions in both: not the channel axis a conv or
    linear layer read (their sizes), and sized alike up to an integer stride."""
    if out.dim() != leaf.dim() or out.dim() < 3:
        return []
    found = []
    for a in range(1, out.dim()):
        lo, li = int(out.shape[a]), int(leaf.shape[a])
        if lo < 2 or li < 2 or lo in channels or li in channels:
            continue
        if max(lo, li) % min(lo, li) == 0:
            found.append(a)
    return found


def _spread(length: int, k: int) -> list[int]:
    if length <= k:
        return list(range(length))
    return sorted({round((i + 0.5) * length / k - 0.5) for i in range(k)})


def _measure(
    out: Tensor,
    path: str,
    leaf: Tensor,
    sample: int,
    axis: int,
    log: OpLog,
    min_share: float,
    budget: Budget,
) -> Optional[Outreach]:
    length_in, length_out = leaf.shape[axis], out.shape[axis]
    ratio = length_in / length_out
    half = log.field_size + ratio
    for position in _spread(length_out, 3):
        if budget.left() <= 0:
            break
        centre = (position + 0.5) * ratio - 0.5
        lo, hi = max(0, int(centre - half)), min(length_in - 1, int(centre + half) + 1)
        target = out[sample].select(axis - 1, position)
        (grad,) = weighted_grads(target, [(path, leaf)])
        if grad is None:
            continue
        g = grad[sample].detach().double().abs().movedim(axis - 1, 0).reshape(length_in, -1)
        profile = g.amax(dim=1)
        inside = torch.zeros(length_in, dtype=torch.bool)
        inside[lo : hi + 1] = True
        own = float(g[inside.to(g.device)].norm())
        other = float(g[~inside.to(g.device)].norm())
        share = other / own if own > 0 else (float("inf") if other > 0 else 0.0)
        if other > 0 and share > min_share:
            hit = (profile.cpu() > 0) & ~inside
            reached = [int(j) for j in torch.nonzero(hit).flatten().tolist()]
            return Outreach(axis, position, (lo, hi), reached, share, path)
    return None


def receptive_field(
    model: nn.Module, batch: Any, loss_fn: LossFn, *, min_share: float, budget: Budget
) -> FieldResult:
    """Read the field the forward's ops make; measure a few output positions against it.

    Raises:
        CannotJudge: no batch, no per-sample output, or no input to differentiate.
    """
    n = batch_size(batch)
    if n is None:
        raise CannotJudge("one_sample", "the batch has no leading dimension shared by its tensors")
    copy = shared_copy(model)
    for mod in copy.modules():
        if isinstance(mod, _BatchNorm):
            mod.eval()
    result = FieldResult(sample=n // 2, memory_bytes=own_bytes(copy))
    modules = _module_reach_all(copy)
    if modules:  # the module graph already reaches every position: no forward needed
        result.reach_all = modules
        result.not_judged["positions"] = f"every position is in reach: {modules[0]}"
        result.reason = "reaches_every_position"
        return result
    log = OpLog()
    out, leaves = _forward(copy, batch, loss_fn, n, log)
    result.field_size = log.field_size
    result.reach_all = log.reach_all
    result.reshape = next((r for r in log.reshapes if r.regroup), None)
    pairs = [(p, t, a) for p, t in leaves for a in _position_axes(out, t, log.channels)]
    if not pairs:
        result.not_judged["positions"] = (
            f"no input has the per-sample output {tuple(out.shape[1:])}'s position axes"
        )
        result.reason = "no_position_axis"
        return result
    if result.reach_all:
        result.not_judged["positions"] = f"every position is in reach: {result.reach_all[0]}"
        result.reason = "reaches_every_position"
        return result
    for path, leaf, axis in pairs:
        if 2 * (log.field_size + leaf.shape[axis] / out.shape[axis]) + 1 >= leaf.shape[axis]:
            result.not_judged[f"axis {axis}"] = (
                f"the layers' receptive field ({log.field_size:g} positions) covers the "
                f"{leaf.shape[axis]} positions of {path}"
            )
            continue
        result.axes.append(axis)
        found = _measure(out, path, leaf, result.sample, axis, log, min_share, budget)
        if found is not None:
            result.outreach = found
            break
    if not result.axes:
        result.reason = "field_covers_axis"
    return result
