"""Optimizers that update through a base optimizer sharing their ``param_groups``, written
out as their authors ship them (trimmed), and a two-layer model with an optional ghost.

SAM (sharpness-aware minimization, as in the widely copied ``davda54/sam``) is called as
``first_step``/``second_step`` and never runs its own ``step()``: the update is its
``base_optimizer.step()``. timm's Lookahead runs its base's ``step()`` inside its own.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, Callable, Optional

import torch
from torch import nn


class SAM(torch.optim.Optimizer):
    def __init__(self, params: Any, base: type, rho: float = 0.05, **kwargs: Any) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.norm(2) for g in grads]).norm(2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * scale)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        assert closure is not None
        self.first_step(zero_grad=True)
        torch.enable_grad()(closure)()
        self.second_step()


class OldTimmLookahead(torch.optim.Optimizer):
    """timm's Lookahead before 1.0: shares its base's groups, never runs ``Optimizer.__init__``
    (so it has no step-hook registries: only its base can be hooked)."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2) -> None:
        self.base_optimizer = base
        self.param_groups, self.defaults = base.param_groups, base.defaults
        self.state = defaultdict(dict)
        self.k, self.calls = k, 0

    def _base(self) -> torch.optim.Optimizer:
        return self.base_optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = self._base().step(closure)
        self.calls += 1
        if self.calls % self.k == 0:
            with torch.no_grad():
                for p in (p for g in self.param_groups for p in g["params"]):
                    slow = self.state.setdefault(p, p.detach().clone())
                    slow.add_(p - slow, alpha=0.5)
                    p.copy_(slow)
        return loss


class Lookahead(OldTimmLookahead):
    """A Lookahead that runs ``Optimizer.__init__``: its own step is hooked, and its base's."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 3) -> None:
        torch.optim.Optimizer.__init__(self, base.param_groups, dict(base.defaults))
        self.param_groups, self.state = base.param_groups, defaultdict(dict)
        self._base_optimizer, self.k, self.calls = base, k, 0

    def _base(self) -> torch.optim.Optimizer:
        return self._base_optimizer


class TimmLookahead(OldTimmLookahead):
    """timm 1.0's: the registries made by hand, the base kept as ``_base_optimizer``."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2) -> None:
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        super().__init__(base, k)
        self._base_optimizer = self.__dict__.pop("base_optimizer")

    def _base(self) -> torch.optim.Optimizer:
        return self._base_optimizer


def ghost_model(width: int, ghost: bool) -> nn.ModuleDict:
    """``a`` -> ``b`` is the forward (the callers write it); ``ghost`` (if asked) never runs."""
    torch.manual_seed(0)
    parts = {"a": nn.Linear(width, width), "b": nn.Linear(width, 1)}
    if ghost:
        parts["ghost"] = nn.Linear(width, width)
    return nn.ModuleDict(parts)
