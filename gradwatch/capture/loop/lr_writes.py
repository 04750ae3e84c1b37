"""Hyperparameters written where the optimizer's ``step()`` never reads them.

A torch optimizer's ``step()`` reads each param group's dict (``group["lr"]``) and nothing
else. Three writes miss it, and each is read at the optimizer's steps, with no hook on the
hot path:

- *an attribute*: ``opt.lr = 1e-4`` sets a Python attribute a torch optimizer never reads
  (read: the optimizer's instance attributes named as a group hyperparameter, whose value no
  group holds);
- *the defaults*: ``opt.defaults["lr"] = ...`` after construction only reaches groups added
  later (read: ``defaults`` changed since the watch began, no group added, no group holds it);
- *another optimizer*: a scheduler or a ``for g in old.param_groups: g["lr"] = ...`` on an
  optimizer object that holds the same parameters but is never stepped (an optimizer built
  again after its scheduler). The other optimizers holding a watched optimizer's first
  parameter are found once (a few ``gc.get_referrers``), each gets a step hook that counts
  its steps, and at each step their group learning rates are compared with the last.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["IgnoredWrite", "LrWrites"]

_HPARAMS = ("lr", "momentum", "weight_decay", "betas", "eps", "dampening", "alpha")
_MAX_OTHERS = 4  # other optimizers followed per watched optimizer, at most


@dataclass(frozen=True)
class IgnoredWrite:
    """A hyperparameter written where optimizer ``k``'s ``step()`` does not read it."""

    k: int
    kind: str  # "attribute", "defaults" or "other_optimizer"
    hparam: str
    written: Any
    used: tuple[Any, ...]  # the value each group of optimizer k holds
    other: Optional[str] = None  # the other optimizer's class


class _Other:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.ref = opt
        self.steps = 0
        self.lrs = _lrs(opt)
        self.handle = opt.register_step_post_hook(self._stepped)

    def _stepped(self, *_: Any) -> None:
        self.steps += 1


def _lrs(opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    return tuple(_plain(g.get("lr")) for g in opt.param_groups)


def _plain(v: Any) -> Any:
    return float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v


def _holders(p: torch.Tensor) -> list[torch.optim.Optimizer]:
    """The optimizers whose groups hold ``p``: param list -> group -> ``param_groups`` ->
    the optimizer (or its ``__dict__``), one ``gc.get_referrers`` per level."""
    plists = [x for x in gc.get_referrers(p) if isinstance(x, list)]
    if not plists:
        return []
    ids = {id(x) for x in plists}
    groups = [
        d for d in gc.get_referrers(*plists) if isinstance(d, dict) and id(d.get("params")) in ids
    ]
    if not groups:
        return []
    lists = [x for x in gc.get_referrers(*groups) if isinstance(x, list)]
    if not lists:
        return []
    ids = {id(x) for x in lists}
    found = gc.get_referrers(*lists)
    dicts = [d for d in found if isinstance(d, dict) and id(d.get("param_groups")) in ids]
    if dicts:
        found = found + gc.get_referrers(*dicts)
    out: list[torch.optim.Optimizer] = []
    for o in found:
        if (
            isinstance(o, torch.optim.Optimizer)
            and id(o.param_groups) in ids
            and all(o is not x for x in out)
        ):
            out.append(o)
    return out


class LrWrites:
    """Per watched optimizer: the writes its ``step()`` ignores (see the module docstring)."""

    def __init__(self) -> None:
        self._defaults: dict[int, tuple[dict[str, Any], int]] = {}
        self._others: dict[int, list[_Other]] = {}
        self._own: dict[int, tuple[Any, ...]] = {}
        self._told: set[tuple[int, str, str, str]] = set()

    def watch(self, k: int, opt: Any) -> None:
        """At a layout sync: what optimizer ``k`` holds now, and the others over its params."""
        if not isinstance(opt, torch.optim.Optimizer) or k in self._own:
            return
        self._defaults_of(k, opt)
        self._other(k, opt)

    def read(self, k: int, opt: torch.optim.Optimizer) -> list[IgnoredWrite]:
        """At a step of optimizer ``k``: the writes it did not use (each told once)."""
        if not isinstance(opt, torch.optim.Optimizer) or not opt.param_groups:
            return []
        out = self._attributes(k, opt) + self._defaults_of(k, opt) + self._other(k, opt)
        fresh = []
        for w in out:
            key = (w.k, w.kind, w.hparam, repr(w.written))
            if key not in self._told:
                self._told.add(key)
                fresh.append(w)
        return fresh

    def _attributes(self, k: int, opt: torch.optim.Optimizer) -> list[IgnoredWrite]:
        if not type(opt).__module__.startswith("torch.optim"):
            return []  # a custom optimizer may read its own attributes
        own = vars(opt)
        out = []
        for h in _HPARAMS:
            if h in own and h in opt.param_groups[0]:
                used = tuple(_plain(g.get(h)) for g in opt.param_groups)
                v = _plain(own[h])
                if all(u != v for u in used):
                    out.append(IgnoredWrite(k, "attribute", h, v, used))
        return out

    def _defaults_of(self, k: int, opt: torch.optim.Optimizer) -> list[IgnoredWrite]:
        snap = self._defaults.get(k)
        now = {h: _plain(opt.defaults.get(h)) for h in _HPARAMS if h in opt.defaults}
        n = len(opt.param_groups)
        self._defaults[k] = (now, n)
        if snap is None or snap[1] != n:
            return []
        out = []
        for h, v in now.items():
            if snap[0].get(h) == v:
                continue  # unchanged since the last step (the usual case): no group read
            used = tuple(_plain(g.get(h)) for g in opt.param_groups)
            if all(u != v for u in used):
                out.append(IgnoredWrite(k, "defaults", h, v, used))
        return out

    def _other(self, k: int, opt: torch.optim.Optimizer) -> list[IgnoredWrite]:
        others = self._others.get(k)
        own = _lrs(opt)
        before, self._own[k] = self._own.get(k), own
        if others is None:
            first = next((p for g in opt.param_groups for p in g["params"]), None)
            found = [o for o in _holders(first) if o is not opt] if first is not None else []
            self._others[k] = [_Other(o) for o in found[:_MAX_OTHERS]]
            return []
        out = []
        for o in others:
            now = _lrs(o.ref)
            if now != o.lrs and o.steps == 0 and before == own:
                written = now[0] if len(set(now)) == 1 else now
                out.append(
                    IgnoredWrite(k, "other_optimizer", "lr", written, own, type(o.ref).__name__)
                )
            o.lrs, o.steps = now, 0
        return out

    def remove(self) -> None:
        for others in self._others.values():
            for o in others:
                o.handle.remove()
        self._others.clear()
        self._defaults.clear()
        self._own.clear()
