"""The optimizers as configured: each param group's hyperparameters and the kinds of
parameters it holds (norm gains, biases, embeddings), read once per layout.

:func:`read_groups` describes every group; :func:`degenerate` says which hyperparameters
make an Adam-family optimizer another optimizer (betas written as ``1 - beta``, ``beta2 <
beta1``); :func:`decay_misses` says where weight decay reaches parameters the user's own
grouping meant to exclude. Nothing here reads tensor values: the measured side (an ``eps``
that dominates ``sqrt(v)``) is :func:`gradwatch.measure.moments.eps_dominance`.

Example:
    >>> import torch
    >>> opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), betas=(0.1, 0.001))
    >>> [d.hparam for d in degenerate(read_groups([opt], {}, lambda p: "w"))]
    ['betas']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = [
    "DecayMiss",
    "Degenerate",
    "GroupInfo",
    "decay_misses",
    "degenerate",
    "param_kinds",
    "read_groups",
]

KINDS = ("norm", "norm_bias", "bias", "embedding")


@dataclass(frozen=True)
class GroupInfo:
    """One param group of one watched optimizer."""

    optimizer: int
    group: int
    cls: str  # the optimizer's class name
    hparams: dict[str, Any]  # betas, eps, weight_decay, lr, momentum (what the group has)
    names: dict[str, list[str]] = field(default_factory=dict)  # kind -> parameter names

    @property
    def decay(self) -> float:
        wd = self.hparams.get("weight_decay", 0.0)
        return float(wd) if isinstance(wd, (int, float)) else 0.0

    @property
    def adam_family(self) -> bool:
        return "adam" in self.cls.lower() and isinstance(self.hparams.get("betas"), tuple)


@dataclass(frozen=True)
class Degenerate:
    """A hyperparameter that makes the optimizer another one."""

    group: GroupInfo
    hparam: str
    message: str
    hint: str


@dataclass(frozen=True)
class DecayMiss:
    """Parameters of one kind decayed although the grouping meant to exclude that kind."""

    kind: str
    names: list[str]
    groups: list[tuple[int, int]]  # (optimizer, group) that decay them
    excluded: Optional[tuple[int, int]]  # the user's no-decay group, if any
    reason: str  # "partial": some of the kind excluded; "unmatched": the no-decay list
    # matched none of them; "all": AdamW decays every norm gain and bias


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)


def _norm_module(mod: nn.Module) -> bool:
    return isinstance(mod, _NORMS) or "norm" in type(mod).__name__.lower()


def param_kinds(model: nn.Module) -> dict[int, str]:
    """``id(param) -> "norm" | "norm_bias" | "bias" | "embedding"`` for those kinds (a norm
    layer's gain, its shift, any other bias, an embedding table)."""
    out: dict[int, str] = {}
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                continue  # a lazy module's: no shape yet (read again once materialised)
            bias = pname == "bias" or pname.endswith("_bias")
            if isinstance(mod, nn.Embedding) or (
                "embedding" in type(mod).__name__.lower() and p.dim() == 2
            ):
                out.setdefault(id(p), "embedding")
            elif _norm_module(mod) and p.dim() <= 1:  # a norm's shift is its own kind
                out.setdefault(id(p), "norm_bias" if bias else "norm")
            elif bias:
                out.setdefault(id(p), "bias")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and value.device.type == "cpu" else None
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value if isinstance(value, (int, float, bool)) or value is None else None


def read_groups(
    optimizers: list[Any], kinds: Mapping[int, str], name: Callable[[torch.Tensor], str]
) -> list[GroupInfo]:
    """Every param group of ``optimizers``: hyperparameters and the names of each kind."""
    out = []
    for k, opt in enumerate(optimizers):
        for g, group in enumerate(getattr(opt, "param_groups", None) or []):
            if not isinstance(group, Mapping):
                continue
            hp = {
                key: _plain(group[key])
                for key in ("betas", "eps", "weight_decay", "lr", "momentum")
                if key in group
            }
            names: dict[str, list[str]] = {}
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor) and p.requires_grad:
                    names.setdefault(kinds.get(id(p), "other"), []).append(name(p))
            out.append(GroupInfo(k, g, type(opt).__name__, hp, names))
    return out


def degenerate(groups: list[GroupInfo]) -> list[Degenerate]:
    """Adam-family groups whose betas make it another optimizer (see the module docstring).

    ``beta1 = 0`` (GANs) and any ``0 <= beta1 < beta2 < 1`` in use (0.9/0.95, 0.5/0.999) are
    fine; an unknown optimizer, or one without ``betas``, is never judged.
    """
    out = []
    for g in groups:
        betas = g.hparams.get("betas")
        if not g.adam_family or not isinstance(betas, tuple) or len(betas) != 2:
            continue
        b1, b2 = betas
        if not all(isinstance(b, (int, float)) for b in betas):
            continue
        if b2 < 0.5 and b1 < 0.5:
            fixed = (round(1 - b1, 6), round(1 - b2, 6))
            out.append(
                Degenerate(
                    g,
                    "betas",
                    f"betas={betas} look like 1 - beta: beta2 = {b2} averages the squared "
                    f"gradient over about {1 / max(1 - b2, 1e-12):.1f} steps, so Adam divides "
                    "by the current gradient (sign descent)",
                    f"betas are decay rates close to 1: did you mean betas={fixed}?",
                )
            )
        elif b2 < b1:
            out.append(
                Degenerate(
                    g,
                    "betas",
                    f"betas={betas}: beta2 < beta1, so the second moment forgets faster than "
                    "the first and the step is unstable",
                    f"swap them: betas=({b2}, {b1}) (the usual beta2 is 0.95-0.999)",
                )
            )
    return out


def decay_misses(groups: list[GroupInfo], transformer: bool) -> list[DecayMiss]:
    """Where weight decay reaches parameters the grouping meant to exclude.

    - A kind (norm gains, biases, embeddings) with parameters in a no-decay group and in a
      decayed group: the exclusion list missed some of them (``partial``).
    - A no-decay group of biases while every norm gain is decayed: the list's norm names
      match none of the model's (transformers#16908, ``unmatched``).
    - No no-decay group, an AdamW-family optimizer decaying every norm gain and bias of a
      transformer (lit-llama#254, ``all``).

    SGD decaying everything (torchvision's recipe) and a grouping that excludes only norm
    gains (torchvision's ``norm_weight_decay=0``) are fine.
    """
    by_opt: dict[int, list[GroupInfo]] = {}
    for g in groups:
        by_opt.setdefault(g.optimizer, []).append(g)
    out: list[DecayMiss] = []
    for opt_groups in by_opt.values():
        out.extend(_misses_of(opt_groups, transformer))
    return out


def _misses_of(groups: list[GroupInfo], transformer: bool) -> list[DecayMiss]:
    decayed = [g for g in groups if g.decay > 0]
    excluded = [g for g in groups if g.decay == 0 and any(g.names.get(k) for k in KINDS)]
    if not decayed:
        return []
    out = []
    if excluded:
        ex = excluded[0]
        for kind in KINDS:
            held = [g for g in excluded if g.names.get(kind)]
            hit = [g for g in decayed if g.names.get(kind)]
            if hit and held:
                out.append(_miss(kind, hit, ex, "partial"))
        norms_hit = [g for g in decayed if g.names.get("norm")]
        held_norms = any(g.names.get("norm") for g in excluded)
        if norms_hit and not held_norms and any(g.names.get("bias") for g in excluded):
            out.append(_miss("norm", norms_hit, ex, "unmatched"))
        return out
    decoupled = [g for g in decayed if "adamw" in g.cls.lower()]
    if transformer and decoupled and any(g.names.get("norm") for g in decoupled):
        hit = [g for g in decoupled if g.names.get("norm") or g.names.get("bias")]
        out.append(_miss("norm", hit, None, "all"))
    return out


def _miss(kind: str, hit: list[GroupInfo], ex: Optional[GroupInfo], reason: str) -> DecayMiss:
    kinds = ("norm", "norm_bias", "bias") if reason == "all" else (kind,)
    names = [n for g in hit for k in kinds for n in g.names.get(k, [])]
    where = (ex.optimizer, ex.group) if ex is not None else None
    return DecayMiss(kind, names, [(g.optimizer, g.group) for g in hit], where, reason)
