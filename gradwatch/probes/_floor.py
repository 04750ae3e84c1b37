"""The loss curve of the ``does_not_learn`` probe read: still falling, heading where, and
whether its floor is the objective's own.

The probe's target, a fall to ``ratio`` of the start, holds for a loss whose floor is 0 (a
cross-entropy, a squared error): a model that cannot approach 0 on one batch has a bug. A
loss below 0 has no such floor: a maximised objective written negated (a universal
adversarial perturbation bounded by ``eps`` starts negative and can fall only as far as the
budget lets it), or a continuous negative log-likelihood, whose floor is the data's entropy
under the model's family (a Gaussian's mean and log-std). The evidence is the sign: the
start is below 0, or a copy trained on one sample takes the loss below 0 (a density can
narrow onto one point; a cross-entropy or squared error never crosses 0). Such a loss is
judged by convergence: it fell, it stopped falling, and every layer the optimizer holds
moved. A loss that rises or does not move, or a layer that does not, stays a finding.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from gradwatch.vectors.sensitivity import layer_groups

MOVED = 1e-7  # |w - w0| / |w0| at or below this: the layer did not move

__all__ = ["FELL", "asymptote", "converged", "frozen_share", "goes_below_zero", "still_falling"]

FELL = 1e-3  # of |start|: the least fall that is progress on a loss with no floor at 0


def still_falling(curve: list[float]) -> bool:
    """Whether the curve is not at a floor yet, only descending slowly (a small learning
    rate): its last quarter still fell by more than 1 % of the start, or it fell (by more
    than ``FELL``) at no less than half the whole curve's mean rate. A floor decelerates; a
    steady descent too slow for 1 % a quarter (a model whose gradients are small at the
    user's rate, cut short by the budget) does not."""
    tail = curve[-max(len(curve) // 4, 2) :]
    drop = tail[0] - min(tail)
    if drop > 0.01 * abs(curve[0]):
        return True
    whole = curve[0] - curve[-1]
    if whole <= FELL * abs(curve[0]) or drop <= 0:
        return False
    return drop / (len(tail) - 1) >= 0.5 * whole / (len(curve) - 1)


def asymptote(curve: list[float]) -> Optional[float]:
    """Where a decelerating curve is heading (Aitken's delta-squared over its last half), or
    ``None`` when it is not decelerating (a steady or speeding-up descent has no floor yet)."""
    n = len(curve)
    if n < 8:
        return None
    a, b, c = curve[n // 2], curve[(3 * n) // 4], curve[-1]
    d1, d2 = a - b, b - c
    if not (d1 > 0 and 0 <= d2 < 0.7 * d1):
        return None
    return c - d2 * d2 / (d1 - d2)


def frozen_share(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> float:
    """The share of the model's parameter elements that do not require grad or that the
    user's optimizer does not hold (a classifier a perturbation is trained against)."""
    held = None
    if optimizer is not None:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    total = frozen = 0
    for p in model.parameters():
        total += p.numel()
        out = not p.requires_grad or (held is not None and id(p) not in held)
        frozen += p.numel() if out else 0
    return frozen / total if total else 0.0


def goes_below_zero(start: float, low: float, one_sample: Callable[[], list[float]]) -> str:
    """The evidence that the loss has no floor at 0, or ``""``: a start below 0, a curve
    (lowest ``low``) that crosses 0, or one on one sample (``one_sample()``, run only then)."""
    if start < 0:
        return f"the loss starts below 0 ({start:.4g})"
    if low < 0:
        return f"the loss fell below 0 ({low:.4g})"
    low = min((c for c in one_sample() if math.isfinite(c)), default=math.inf)
    if low < 0:
        return f"a copy trained on one sample takes the loss below 0 ({low:.4g})"
    return ""


def converged(curve: list[float], unmoved: list[str]) -> bool:
    """It fell by more than ``FELL`` of its start and stopped falling, every held layer moved."""
    if unmoved or len(curve) < 8:
        return False
    finite = [c for c in curve if math.isfinite(c)]
    if len(finite) != len(curve):
        return False
    return min(curve) < curve[0] - FELL * abs(curve[0]) and not still_falling(curve)


def not_moved(model: nn.Module, clone: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The layers whose copy still equals the user's weights, among those the optimizer
    holds (a layer it does not hold cannot move by design: a frozen classifier)."""
    before = dict(model.named_parameters())
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    out = []
    for name, names, params in layer_groups(clone):
        if not any(id(p) in held for p in params):
            continue
        moved = False
        for pname, p in zip(names, params):
            old = before.get(pname)
            if old is None or old.shape != p.shape:
                moved = True
                break
            with torch.no_grad():
                diff = float((p.detach().double() - old.detach().double().to(p.device)).norm())
                size = float(old.detach().double().norm())
            if diff > MOVED * max(size, 1e-12):
                moved = True
                break
        if not moved:
            out.append(name)
    return out


def unreached(clone: nn.Module) -> list[str]:
    """The layers none of whose parameters has a gradient after the copy's last backward:
    outside the loss's graph (a ghost, reported as such), not a cause of its floor."""
    return [name for name, _, params in layer_groups(clone) if all(p.grad is None for p in params)]
