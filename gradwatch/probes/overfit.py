"""The ``does_not_learn`` probe: overfit one small fixed batch with the user's own optimizer.

A new instance of the user's optimizer class, with its param groups' hyperparameters (the
learning rate a scheduler started from, ``initial_lr``, when one is attached: a warm-up at 0
is no verdict), on a copy of the model, takes up to ``steps`` steps on the first samples of
the batch, each evaluation seeded alike (dropout draws one mask: the objective is one fixed
function). The loss must fall to ``ratio`` of its start (by ``(1 - ratio) |start|``). The
layers that did not move are those whose copy still equals the user's own weights.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from gradwatch.probes._floor import (
    FELL,
    asymptote,
    converged,
    frozen_share,
    goes_below_zero,
    not_moved,
    still_falling,
    unreached,
)
from gradwatch.probes._sandbox import (
    Budget,
    CannotJudge,
    LossFn,
    batch_size,
    evaluate,
    fresh_copy,
    param_bytes,
    slice_batch,
)

__all__ = ["OverfitResult", "overfit_one_batch"]

SEED = 31337
FEW = 2  # samples of the capacity retry (Karpathy's recipe: overfit "as little as two")
RETRY_SHARE = 0.2  # of budget_s, at least, for that retry
FROZEN_MAJORITY = 0.5  # of the parameters frozen: an adapter on a base it cannot judge
#: Fewer steps than this, cut by the time budget, judge nothing: AdamW at 1e-3 moves a weight
#: by about 1e-3 a step, and a loaded machine gave a correct model 6 steps (no fall is no news).
MIN_JUDGED = 20


@dataclass
class OverfitResult:
    """The losses before each step, what the loss had to reach, what did not move."""

    curve: list[float] = field(default_factory=list)
    target: float = 0.0
    optimizer: str = ""
    steps: int = 0
    stopped_by_budget: bool = False
    diverged: bool = False
    not_moved: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)  # of those, the ones no gradient reached
    memory_bytes: int = 0
    boosted: list[float] = field(default_factory=list)  # the run at 10 x the rate, if any
    floor_estimate: Optional[float] = None  # where a decelerating curve is heading
    no_zero_floor: str = ""  # the evidence that the loss's floor is not 0 (judged by convergence)
    converged: bool = False  # it fell and stopped at its own floor, every trained layer moved

    @property
    def start(self) -> float:
        return self.curve[0]

    @property
    def floor(self) -> float:
        finite = [c for c in [*self.curve, *self.boosted] if math.isfinite(c)]
        return min(finite) if finite else math.nan

    @property
    def learned(self) -> bool:
        return not self.diverged and (self.floor <= self.target or self.converged)


def _real(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost torch optimizer: accelerate's ``AcceleratedOptimizer`` (which the
    Hugging Face Trainer always hands over) subclasses ``Optimizer`` but wraps the real one
    in ``.optimizer``, and its constructor takes that optimizer, not param groups."""
    found: Optional[torch.optim.Optimizer] = None
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            found = optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return found


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in sig.parameters}


def copy_optimizer(
    optimizer: Any, model: nn.Module, clone: nn.Module
) -> tuple[torch.optim.Optimizer, str]:
    """The user's optimizer class and hyperparameters over ``clone``'s parameters, no state.

    Raises:
        CannotJudge: it holds none of the model's parameters or cannot be re-created.
    """
    if optimizer is None:
        params = [p for p in clone.parameters() if p.requires_grad]
        if not params:
            raise CannotJudge("no_parameters", "the model has no trainable parameters")
        return torch.optim.Adam(params, lr=1e-3), "Adam(lr=0.001), no optimizer given"
    real = _real(optimizer)
    if real is None:
        raise CannotJudge("no_optimizer", f"{type(optimizer).__name__} is not a torch optimizer")
    index = {id(p): k for k, p in enumerate(model.parameters())}
    mine = list(clone.parameters())
    groups = []
    for g in real.param_groups:
        params = [mine[index[id(p)]] for p in g["params"] if id(p) in index]
        if params:
            hp = {k: v for k, v in g.items() if k != "params"}
            if "initial_lr" in hp:  # a scheduler's start, not its warm-up's first value
                hp["lr"] = hp["initial_lr"]
            groups.append({"params": params, **hp})
    if not groups:
        raise CannotJudge("no_parameters", "the optimizer holds none of the model's parameters")
    cls = type(real)
    try:
        made = cls(groups, **_accepted(cls, dict(real.defaults)))
    except Exception as exc:
        raise CannotJudge(
            "optimizer_not_copyable", f"{cls.__name__} cannot be re-created ({exc})"
        ) from exc
    lrs = sorted({float(g.get("lr", 0.0)) for g in groups})
    return made, f"{cls.__name__}(lr={', '.join(f'{lr:g}' for lr in lrs)})"


def _train(
    clone: nn.Module,
    small: Any,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    result: OverfitResult,
    *,
    steps: int,
    budget: Budget,
) -> list[float]:
    """Up to ``steps`` steps; the loss before each (a run stops at ``result.target``)."""
    curve: list[float] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = evaluate(clone, small, loss_fn, SEED)
        value = float(loss.detach())
        curve.append(value)
        if not math.isfinite(value):
            result.diverged = True
            break
        if value <= result.target:
            break
        if budget.left() <= 0:
            result.stopped_by_budget = True
            break
        torch.autograd.backward(loss)  # not Tensor.backward: a watcher's wrapper is not for us
        opt.step()
    return curve


def _start(clone: nn.Module, small: Any, loss_fn: LossFn, ratio: float) -> float:
    """The loss at the start, and what it must reach (its target)."""
    loss = evaluate(clone, small, loss_fn, SEED)
    value = float(loss.detach())
    if not loss.requires_grad:
        raise CannotJudge("not_differentiable", "the loss does not require grad")
    if not math.isfinite(value):
        raise CannotJudge("nonfinite_loss", "the loss is not finite at the start")
    if value == 0.0:
        raise CannotJudge("loss_at_zero", "the loss is already 0 at the start")
    return value - (1.0 - ratio) * abs(value)


def _fit(
    model: nn.Module,
    small: Any,
    loss_fn: LossFn,
    optimizer: Any,
    *,
    steps: int,
    ratio: float,
    budget: Budget,
) -> OverfitResult:
    """One attempt on ``small``: the user's rate, then 10 x that rate if still falling."""
    clone = fresh_copy(model)
    opt, described = copy_optimizer(optimizer, model, clone)
    result = OverfitResult(optimizer=described, memory_bytes=param_bytes(clone))
    result.target = _start(clone, small, loss_fn, ratio)
    result.curve = _train(clone, small, loss_fn, opt, result, steps=steps, budget=budget)
    result.steps = len(result.curve)
    if result.learned or result.diverged:
        result.not_moved = [] if result.learned else not_moved(model, clone, opt)
        return result
    if still_falling(result.curve) and budget.left() > 0:
        del clone, opt
        clone = fresh_copy(model)
        opt, _ = copy_optimizer(optimizer, model, clone)
        try:
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 10.0
        except TypeError:  # no numeric lr (a relative-step Adafactor): no second run
            pass
        else:
            result.boosted = _train(clone, small, loss_fn, opt, result, steps=steps, budget=budget)
            result.diverged = False  # 10 x may diverge: that says nothing of the user's rate
            if result.boosted and min(result.boosted) <= result.target:
                return result
    curve = result.boosted or result.curve
    if result.stopped_by_budget and len(result.curve) < min(MIN_JUDGED, steps):
        raise CannotJudge(
            "budget",
            f"the time budget allowed only {len(result.curve)} steps, too few to judge "
            f"({curve[0]:.4g} -> {min(curve):.4g}, target {result.target:.4g}): raise budget_s",
            partial=result,
        )
    result.not_moved = not_moved(model, clone, opt)
    result.unreached = [n for n in unreached(clone) if n in result.not_moved]
    heading = asymptote(curve) if result.boosted else None
    if heading is not None and heading > result.target:
        result.floor_estimate = heading
    elif still_falling(curve):
        why = "the time budget ran out" if budget.left() <= 0 else "steps ran out"
        raise CannotJudge(
            "still_falling",
            f"{why} after {len(curve)} steps with the loss still falling "
            f"({curve[0]:.4g} -> {min(curve):.4g}, target {result.target:.4g}), also at "
            "10 x the learning rate: raise its steps or budget_s",
            partial=result,
        )
    return result


def _too_small(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Any,
    failed: OverfitResult,
    *,
    steps: int,
    ratio: float,
    budget: Budget,
) -> bool:
    """Whether a copy that trained everywhere but stopped at a floor fits ``FEW`` samples.

    Then the floor is the model's capacity on more samples (a linear model on random
    targets), not a bug: a softmax before the loss, a squashed output, a rate of 0 or a
    frozen layer cannot fit two samples either. A layer that did not move is a bug whatever
    the capacity, so such a result is not retried; one that no gradient reached is outside
    the loss (a ghost, reported as such), so it is no cause of the floor.
    """
    size = batch_size(batch)
    if set(failed.not_moved) - set(failed.unreached) or size is None or size <= FEW:
        return False
    retry = Budget(max(budget.left(), RETRY_SHARE * budget.seconds))
    try:
        few = _fit(
            model,
            slice_batch(batch, FEW),
            loss_fn,
            optimizer,
            steps=steps,
            ratio=ratio,
            budget=retry,
        )
    except CannotJudge:
        return False
    return few.learned


def _own_floor(
    model: nn.Module,
    small: Any,
    loss_fn: LossFn,
    optimizer: Any,
    result: OverfitResult,
    *,
    steps: int,
    budget: Budget,
) -> bool:
    """Whether a loss with no floor at 0 fell and stopped with every held layer moving: it
    is at the objective's own floor (:mod:`._floor`); sets ``result.converged``."""
    curve = result.boosted or result.curve
    if not converged(curve, sorted(set(result.not_moved) - set(result.unreached))):
        return False

    def one_sample() -> list[float]:
        clone = fresh_copy(model)
        opt, _ = copy_optimizer(optimizer, model, clone)
        free = OverfitResult(target=-math.inf)  # trained to the end: only its sign matters
        retry = Budget(max(budget.left(), RETRY_SHARE * budget.seconds))
        return _train(clone, slice_batch(small, 1), loss_fn, opt, free, steps=steps, budget=retry)

    result.no_zero_floor = goes_below_zero(result.start, min(curve), one_sample)
    result.converged = bool(result.no_zero_floor)
    return result.converged


def overfit_one_batch(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: Any,
    *,
    steps: int,
    ratio: float,
    max_samples: int,
    budget: Budget,
) -> OverfitResult:
    """Train a copy on the first ``max_samples`` samples; stop once the loss reached its target.

    When the user's learning rate leaves the loss still falling at the end, a fresh copy is
    trained again at 10 x that rate: reaching the target then is a pass (the rate is only
    slow on one batch); a floor at 10 x too is the finding; still falling is no verdict. A
    floor reached with every layer moving is tried once more on two samples: fitting those
    means the model is only too small to memorise more (no verdict, ``capacity``).

    Raises:
        CannotJudge: the loss is not differentiable or not finite at the start, the optimizer
            cannot be re-created, the loss was still falling when steps or budget ran out, or
            the model fits two samples but not ``max_samples``.
    """
    small = slice_batch(batch, max_samples)
    result = _fit(model, small, loss_fn, optimizer, steps=steps, ratio=ratio, budget=budget)
    if result.learned or result.diverged:
        return result
    if _own_floor(model, small, loss_fn, optimizer, result, steps=steps, budget=budget):
        return result
    if result.floor >= result.start - FELL * abs(result.start):
        return result  # it never fell: no capacity or frozen base excuses that (a sign, a 0 rate)
    if _too_small(
        model, small, loss_fn, optimizer, result, steps=steps, ratio=ratio, budget=budget
    ):
        raise CannotJudge(
            "capacity",
            f"every layer trained and the loss stopped at {result.floor:.4g} (target "
            f"{result.target:.4g}) on {batch_size(small)} samples, but a copy fits {FEW}: the "
            "model is too small to memorise this many; lower max_samples to judge it",
            partial=result,
        )
    frozen = frozen_share(model, _real(optimizer))
    if frozen >= FROZEN_MAJORITY and not set(result.not_moved) - set(result.unreached):
        raise CannotJudge(
            "frozen_base",
            f"every trained layer moved, but {frozen:.0%} of the parameters are frozen and the "
            f"loss stopped at {result.floor:.4g} (target {result.target:.4g}): what an adapter "
            "can fit is bounded by the frozen base (a random one, in a smoke test, bounds it "
            "tightly), so this is no verdict on the training step",
            partial=result,
        )
    return result
