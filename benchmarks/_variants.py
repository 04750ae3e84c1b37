"""The instrumentation variants the benchmark compares, each on its own model copy.

A variant owns one (model, optimizer) pair and whatever it instruments them with for the
whole run (gradwatch watchers are entered once and exited at the end: attaching is not part
of a step's cost). ``step()`` runs one ordinary training step plus the variant's own work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import gradwatch

__all__ = ["AB_VARIANTS", "VARIANTS", "Variant", "make_variants"]

STAT_CHECKS = ("exploding_grad", "vanishing_grad", "dead_param", "stale_param")
NEW_CHECKS = ("loss_disconnected", "double_update", "unregistered_param", "clipped_while_scaled")

# name -> one-line description (the order is the table's order)
VARIANTS: dict[str, str] = {
    "baseline": "no instrumentation",
    "clip_grad_norm": "torch.nn.utils.clip_grad_norm_ every step (the one-pass reference)",
    "lightning_grad_norm": "pytorch_lightning.utilities.grad_norm(module, norm_type=2) every step",
    "item_loop": "for p in params: p.grad.norm().item() every step (the hand-written check)",
    "noop_hooks": "two empty Python hooks per parameter (the CPython floor for gradwatch's hooks)",
    "gradwatch_default": "gradwatch.watch() with the default config",
    "gradwatch_every_step": "gradwatch with every statistic every step (every_n_steps=1)",
    "gradwatch_hooks_only": "gradwatch with the statistic checks off and every_n_steps=10**9",
    "gradwatch_without_new": "gradwatch default minus the second-round checks (loss_disconnected, "
    "double_update, unregistered_param, clipped_while_scaled, NaN origin tracing)",
    "gradwatch_post_hooks": "gradwatch default with post-accumulate arrival hooks only (no light "
    "ones: capture/grads/deferred.py), as before issue 49's tenth session",
}
# Named with --variants only (an A/B against the default), never part of a default run.
AB_VARIANTS = ("gradwatch_post_hooks",)


@dataclass
class Variant:
    """One instrumentation of the shared (model, optimizer) pair, installed per block."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    after_backward: Optional[Callable[[], Any]] = None
    install: Optional[Callable[[], Callable[[], None]]] = None  # returns its remover
    settle: int = 0  # untimed steps after installing: gradwatch's scan window (scan_horizon)
    sink: Any = None
    _remove: Optional[Callable[[], None]] = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step: zero_grad, forward, backward, [instrumentation], step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.model, x, y).backward()
        if self.after_backward is not None:
            self.sink = self.after_backward()
        self.optimizer.step()

    def open(self) -> None:
        """Install the instrumentation (untimed)."""
        if self.install is not None:
            self._remove = self.install()

    def close(self) -> None:
        """Remove the instrumentation (exit the watcher, remove hooks)."""
        if self._remove is not None:
            self._remove()
            self._remove = None


def _item_loop(model: nn.Module) -> Callable[[], list[float]]:
    params = list(model.parameters())

    def run() -> list[float]:
        return [p.grad.norm().item() for p in params if p.grad is not None]

    return run


def _lightning(model: nn.Module) -> Callable[[], Any]:
    from pytorch_lightning.utilities import grad_norm

    return lambda: grad_norm(model, norm_type=2)


def _clip(model: nn.Module) -> Callable[[], Any]:
    params = list(model.parameters())
    return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf)


def _noop_hooks(model: nn.Module) -> Callable[[], Callable[[], None]]:
    def install() -> Callable[[], None]:
        handles = []
        for p in model.parameters():
            handles.append(p.register_hook(lambda g: None))
            handles.append(p.register_post_accumulate_grad_hook(lambda p: None))

        def remove() -> None:
            for h in handles:
                h.remove()

        return remove

    return install


def _gradwatch(
    model: nn.Module, opt: torch.optim.Optimizer, name: str
) -> Callable[[], Callable[[], None]]:
    def install() -> Callable[[], None]:
        watcher = gradwatch.watch(model, opt, config=gradwatch_config(name))
        if name == "gradwatch_post_hooks":
            watcher._hooks.arrival.light = False
        return watcher.attach().close

    return install


def gradwatch_config(name: str) -> dict[str, Any]:
    """The gradwatch config of a gradwatch variant."""
    if name in ("gradwatch_default", "gradwatch_post_hooks"):
        return {}
    if name == "gradwatch_every_step":
        return {"every_n_steps": 1}
    if name == "gradwatch_hooks_only":
        return {"every_n_steps": 10**9, "checks": {c: {"enabled": False} for c in STAT_CHECKS}}
    if name == "gradwatch_without_new":
        off: dict[str, Any] = {c: {"enabled": False} for c in NEW_CHECKS}
        off["nonfinite_grad"] = {"trace_steps": 0}
        return {"checks": off}
    raise KeyError(name)


def scan_horizon(config: dict[str, Any]) -> int:
    """The steps after attaching during which ``config``'s checks still read extra evidence
    (the longest ``scan_steps`` / ``trace_steps`` of an enabled check: 20 by default, the NaN
    origin's trace). A block timed after them is the steady state a long run pays; one timed
    inside them (a fixed 10, before the fourth round's sources made it 16 and 20) is not."""
    cfg = gradwatch.GradWatchConfig.coerce(config)
    longest = 0
    for name in type(cfg.checks).model_fields:
        check = getattr(cfg.checks, name)
        if check.enabled:
            for key in ("scan_steps", "trace_steps"):
                longest = max(longest, int(getattr(check, key, 0) or 0))
    return longest


def make_variants(
    names: list[str],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    settle: Optional[int] = None,
) -> list[Variant]:
    """One :class:`Variant` per name, all on the same (model, optimizer) pair; a gradwatch
    variant settles ``settle`` steps (default: past its config's scan window)."""
    out = []
    for name in names:
        v = Variant(name, model, opt, loss)
        if name == "clip_grad_norm":
            v.after_backward = _clip(model)
        elif name == "lightning_grad_norm":
            v.after_backward = _lightning(model)
        elif name == "item_loop":
            v.after_backward = _item_loop(model)
        elif name == "noop_hooks":
            v.install = _noop_hooks(model)
        elif name.startswith("gradwatch"):
            v.install = _gradwatch(model, opt, name)
            v.settle = scan_horizon(gradwatch_config(name)) if settle is None else settle
        elif name != "baseline":
            raise KeyError(name)
        out.append(v)
    return out
