"""The ``update_ascends_loss`` probe: one step of the user's optimizer, on a copy, descends.

A new instance of the user's optimizer class with its param groups' hyperparameters (never
its state: :func:`~gradwatch.probes.overfit.copy_optimizer`) takes one step on a copy of
the model; the update ``u = θ1 - θ0`` of each param group must not point up the loss's
gradient ``g`` at ``θ0``: to first order ``loss(θ0 + εu) - loss(θ0) ≈ ε g·u``, and the first
step of every descent method (SGD with or without momentum, Adam and its kin, RMSprop,
Adagrad, Lion, a preconditioned or orthogonalised method, clipping, SAM's final update)
has ``g·u < 0``. What a correct step may add that is not descent is taken out:

- weight decay (``weight_decay`` set to 0 on the copy): its pull towards 0 may ascend the
  loss where the gradient is small;
- a multi-iteration step (LBFGS's ``max_iter`` set to 1): its first iteration is the
  direction, later ones are curvature's;
- random noise in the update (Langevin dynamics): the step is taken twice under two seeds,
  and an update that differs between them is not judged.

A group whose parameters the loss does not reach (no gradient: a GAN's other player), or
whose update is below the float rounding of its weights, is not judged. ``g·u`` above
four times its rounding bound (``Σ |g_i| eps |θ1_i|``) is an ascent.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from gradwatch.probes._sandbox import (
    Budget,
    CannotJudge,
    LossFn,
    evaluate,
    fresh_copy,
    param_bytes,
    seeded,
)
from gradwatch.probes.overfit import copy_optimizer

__all__ = ["AscentResult", "GroupAscent", "update_direction"]

SEED = 7919
NOISE_SEED = 104729
NOISE = 0.05  # an update that differs between two seeds by this share of it is random
ROUNDING = 4.0  # g·u must exceed this many times its rounding bound to be an ascent
NEUTRALISED = {"weight_decay": 0.0, "max_iter": 1}


@dataclass
class GroupAscent:
    """One param group's first-order change of the loss along its update."""

    index: int
    params: list[str]
    lr: Optional[float]
    slope: float = 0.0  # g·u
    cosine: float = 0.0  # g·u / (|g| |u|)
    bound: float = 0.0  # g·u's rounding bound
    status: str = "descends"  # descends / ascends / no_gradient / not_moved / stochastic


@dataclass
class AscentResult:
    """Each param group's verdict, the optimizer re-created, what was set aside."""

    optimizer: str = ""
    groups: list[GroupAscent] = field(default_factory=list)
    neutralised: list[str] = field(default_factory=list)
    memory_bytes: int = 0

    @property
    def ascending(self) -> list[GroupAscent]:
        return [g for g in self.groups if g.status == "ascends"]

    @property
    def judged(self) -> list[GroupAscent]:
        return [g for g in self.groups if g.status in ("descends", "ascends")]


def _neutralise(opt: torch.optim.Optimizer) -> list[str]:
    """Set weight decay and inner iterations aside on the copy: what they were."""
    seen: list[str] = []
    for group in opt.param_groups:
        for key, value in NEUTRALISED.items():
            old = group.get(key)
            if isinstance(old, (int, float)) and not isinstance(old, bool) and old != value:
                group[key] = value
                seen.append(f"{key}={old:g}")
    return sorted(set(seen))


def _step(
    model: nn.Module, clone: nn.Module, batch: Any, loss_fn: LossFn, optimizer: Any, seed: int
) -> tuple[torch.optim.Optimizer, str, list[str], list[Optional[Tensor]], list[Tensor]]:
    """One step on ``clone``: the optimizer, its description, what was set aside, the
    gradient at the start of each of its parameters and their start."""
    opt, described = copy_optimizer(optimizer, model, clone)
    neutral = _neutralise(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in params]

    def closure() -> Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():  # a step under no_grad that calls it without enabling it
            loss = evaluate(clone, batch, loss_fn, SEED)
            if loss.requires_grad:
                torch.autograd.backward(loss)
        return loss

    loss = closure()
    if not loss.requires_grad:
        raise CannotJudge("not_differentiable", "the loss does not require grad")
    if not torch.isfinite(loss.detach()).all():
        raise CannotJudge("nonfinite_loss", "the loss is not finite at the start")
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    seeded(seed)  # the step's own random draws, if any: another seed gives other ones
    if _takes_closure(opt):
        opt.step(closure)  # type: ignore[arg-type]  # torch's stub says float; a loss tensor is what every optimizer gets
    else:
        opt.step()
    return opt, described, neutral, grads, start


def _takes_closure(opt: torch.optim.Optimizer) -> bool:
    try:
        return bool(inspect.signature(opt.step).parameters)
    except (TypeError, ValueError):
        return True


def _noisy(deltas: list[Tensor], ends: list[Tensor], other: list[Tensor]) -> bool:
    """Whether the update differs between two seeds by more than ``NOISE`` of its size (a
    Langevin step's noise; a GPU's reduction order differs by far less)."""
    diff = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(ends, other))
    size = sum(float(d.pow(2).sum()) for d in deltas)
    return diff > (NOISE**2) * size


def _judge(
    index: int,
    names: list[str],
    lr: Any,
    grads: list[Optional[Tensor]],
    deltas: list[Tensor],
    ends: list[Tensor],
) -> GroupAscent:
    rec = GroupAscent(index, names, float(lr) if isinstance(lr, (int, float)) else None)
    pairs = [(g, d, e) for g, d, e in zip(grads, deltas, ends) if g is not None]
    if not pairs or all(float(g.abs().max()) == 0.0 for g, _, _ in pairs):
        rec.status = "no_gradient"
        return rec
    slope = bound = gg = uu = 0.0
    for g, d, e in pairs:
        g64, d64 = g.double(), d.double()
        eps = torch.finfo(e.dtype).eps if e.is_floating_point() else 0.0
        slope += float((g64 * d64).sum())
        bound += float((g64.abs() * e.double().abs()).sum()) * eps
        gg += float((g64 * g64).sum())
        uu += float((d64 * d64).sum())
    rec.slope, rec.bound = slope, bound
    rec.cosine = slope / max((gg * uu) ** 0.5, 1e-300)
    if uu == 0.0 or (uu**0.5) <= ROUNDING * bound / max(gg**0.5, 1e-300):
        rec.status = "not_moved"
    elif slope > ROUNDING * bound:
        rec.status = "ascends"
    return rec


def update_direction(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Any,
    *,
    budget: Optional[Budget] = None,
) -> AscentResult:
    """One step of the user's optimizer class on a copy: each param group's slope ``g·u``.

    Two steps are the measurement (the second under another seed tells a random update):
    ``budget`` does not cut them.

    Raises:
        CannotJudge: no optimizer given, the optimizer cannot be re-created, the loss is not
            differentiable or not finite, or no group has both a gradient and an update.
    """
    if optimizer is None:
        raise CannotJudge("no_optimizer", "no optimizer given: the probe judges the user's own")
    clone = fresh_copy(model)
    names = {id(p): n for n, p in clone.named_parameters()}
    opt, described, neutral, grads, start = _step(model, clone, batch, loss_fn, optimizer, SEED)
    ends = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    # the same step under another seed (both are the measurement: the budget does not cut it)
    twin = fresh_copy(model)
    twin_opt = _step(model, twin, batch, loss_fn, optimizer, NOISE_SEED)[0]
    other = [p.detach() for g in twin_opt.param_groups for p in g["params"]]
    del twin_opt  # its state; the twin's weights stay as ``other``
    twin.zero_grad(set_to_none=True)
    state = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, Tensor)
    )
    result = AscentResult(
        optimizer=described,
        neutralised=neutral,
        memory_bytes=5 * param_bytes(clone) + state,  # the copy, g, θ0, θ1, the twin
    )
    k = 0
    for i, group in enumerate(opt.param_groups):
        n = len(group["params"])
        sl = slice(k, k + n)
        k += n
        deltas = [e.double() - s.double() for e, s in zip(ends[sl], start[sl])]
        rec = _judge(
            i,
            [names.get(id(p), "?") for p in group["params"]],
            group.get("lr"),
            grads[sl],
            deltas,
            ends[sl],
        )
        if rec.status in ("ascends", "descends") and _noisy(deltas, ends[sl], other[sl]):
            rec.status = "stochastic"
        result.groups.append(rec)
    if not result.judged:
        why = sorted({g.status for g in result.groups})
        raise CannotJudge(
            "no_update",
            f"no param group of {described} had both a gradient and an update above rounding "
            f"({', '.join(why)})",
            partial=result,
        )
    return result
