"""The ``sample_weight_depends_on_split`` probe: the whole batch's gradient against its parts'.

Accumulating gradients over micro-batches is correct when each sample (or token) weighs the
same in the update whichever micro-batch it falls in. The probe splits the batch into two
halves of equal size, ``A`` (the first) and ``B`` (the second), as an accumulating loop
would, and takes on a copy of the model (in eval mode: no dropout draws and no batch
statistics couple the samples) the gradient of ``loss_fn`` on the whole batch and on each
half. When the loss treats samples one by one, the whole batch's gradient is a combination
of its halves': ``g = a gA + b gB``, solved by least squares. A loss whose halves weigh
alike (``a = b``: a per-sample mean or a sum) gives the whole batch's update when the loop
adds ``loss(A) / 2 + loss(B) / 2``. A loss that divides by what a half holds (tokens that are
not padding, a class-weighted count) has ``a / b`` equal to the halves' counts' ratio: the
loop's ``loss / k`` weighs the tokens of the half with fewer of them more, and the update
depends on the split.

Not judged: a batch of fewer than four samples; a loss whose halves' gradients are parallel
(a model of one parameter: ``a`` and ``b`` cannot be told apart); a loss that couples samples
(the whole batch's gradient is not a combination of its halves': a contrastive loss, a
graph over the samples, batch-hard mining), which no split of that loss preserves and
accumulation needs its own design for (``details.residual``); a forward that draws random
numbers in eval mode (a VAE's sampled noise, a diffusion model's timesteps: the whole batch
under another seed differs), whose halves draw apart from the whole batch.

Whether the loop accumulates, the probe cannot see: the finding carries the check's severity
when the config says it does (``accumulation_steps`` > 1; ``Watcher.probe`` reads it from
the backward passes per step the run showed) and is ``info`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.probes._sandbox import (
    Budget,
    CannotJudge,
    LossFn,
    _map,
    batch_size,
    evaluate,
    fresh_copy,
    param_bytes,
)

__all__ = ["SplitResult", "split_weights"]

CHUNK = 1 << 20
SEED = 271828
PARALLEL = 1e-6  # 1 - cos² of the halves' gradients below which a and b are not separable
COUPLED = 1e-3  # the fit's residual, relative to the whole batch's gradient, beyond which
# the loss couples samples (fp32 rounding leaves ~1e-6)


@dataclass
class SplitResult:
    """The whole batch's gradient as a combination of its halves'."""

    batch: int = 0
    half: int = 0  # samples in each half
    a: float = 0.0  # the first half's weight in the whole batch's gradient
    b: float = 0.0  # the second half's
    residual: float = 0.0  # |g - a gA - b gB| / |g|
    mode: str = "eval"
    memory_bytes: int = 0

    @property
    def ratio(self) -> float:
        """How much more a sample of the heavier half weighs than one of the lighter."""
        lo, hi = sorted((abs(self.a), abs(self.b)))
        return hi / lo if lo > 0 else math.inf


def _part(batch: Any, n: int, start: int, stop: int) -> Any:
    return _map(batch, lambda t: t[start:stop] if t.dim() > 0 and t.shape[0] == n else t)


def _gradient(
    copy: nn.Module, params: list[nn.Parameter], batch: Any, loss_fn: LossFn, seed: int = SEED
) -> Tensor:
    """The loss's gradient on ``batch``, flattened in float32 (zeros where a parameter got
    none): three of them are held at once, so not in float64 (:func:`_dot` accumulates in
    float64)."""
    loss = evaluate(copy, batch, loss_fn, seed)
    if not loss.requires_grad:
        raise CannotJudge("not_differentiable", "the loss does not require grad")
    if not torch.isfinite(loss.detach()):
        raise CannotJudge("nonfinite_loss", "the loss is not finite")
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if g is None
            else g.detach().reshape(-1).float()
            for p, g in zip(params, grads)
        ]
    )


def _dot(a: Tensor, b: Tensor) -> float:
    """``a · b`` accumulated in float64, a chunk at a time (no float64 copy of a whole one)."""
    return sum(float(x.double() @ y.double()) for x, y in zip(a.split(CHUNK), b.split(CHUNK)))


def split_weights(model: nn.Module, batch: Any, loss_fn: LossFn, *, budget: Budget) -> SplitResult:
    """Each half's weight in the whole batch's gradient (on a copy, in eval mode).

    Raises:
        CannotJudge: too few samples, no trainable parameter, halves whose gradients are
            parallel, or a loss that couples samples.
    """
    n = batch_size(batch)
    if n is None or n < 4:
        raise CannotJudge("few_samples", "the batch has fewer than four samples to split")
    half = n // 2
    copy = fresh_copy(model)
    copy.eval()  # dropout's draws and batch statistics would couple the halves
    params = [p for p in copy.parameters() if p.requires_grad]
    if not params:
        raise CannotJudge("no_params", "the model has no trainable parameter")
    result = SplitResult(
        batch=n, half=half, memory_bytes=param_bytes(copy) + 4 * param_bytes(copy, 4)
    )
    whole = _part(batch, n, 0, 2 * half)
    g = _gradient(copy, params, whole, loss_fn)
    if budget.left() <= 0:
        raise CannotJudge("budget", "the probe ran out of time")
    ga = _gradient(copy, params, _part(batch, n, 0, half), loss_fn)
    gb = _gradient(copy, params, _part(batch, n, half, 2 * half), loss_fn)
    aa, bb, ab = _dot(ga, ga), _dot(gb, gb), _dot(ga, gb)
    det = aa * bb - ab * ab
    if aa == 0.0 or bb == 0.0 or det <= PARALLEL * aa * bb:
        raise CannotJudge(
            "parallel",
            "the halves' gradients are parallel (or zero): their weights in the whole batch's "
            "cannot be told apart",
        )
    ag, bg = _dot(ga, g), _dot(gb, g)
    result.a = (ag * bb - bg * ab) / det
    result.b = (bg * aa - ag * ab) / det
    fit = g - result.a * ga - result.b * gb
    scale = math.sqrt(_dot(g, g))
    result.residual = math.sqrt(_dot(fit, fit)) / scale if scale > 0 else math.inf
    if not result.residual <= COUPLED:
        again = _gradient(copy, params, whole, loss_fn, SEED + 1)
        moved = again - g
        if math.sqrt(_dot(moved, moved)) > COUPLED * scale:
            raise CannotJudge(
                "random",
                "the forward draws random numbers even in eval mode (sampled noise, diffusion "
                "timesteps), which the halves draw apart from the whole batch: not judged",
                partial=result,
            )
        raise CannotJudge(
            "coupled",
            f"the whole batch's gradient is not a combination of its halves' (residual "
            f"{result.residual:.2g}): the loss couples samples, and no split preserves it",
            partial=result,
        )
    return result
