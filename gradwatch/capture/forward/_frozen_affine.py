"""Whether a frozen-looking norm layer is frozen: do its affine values stay put?

``frozen_stats_updated`` flags normalisation layers whose affine parameters all have
``requires_grad=False`` and whose running statistics moved in a training step. Two designs
look the same by flags and modes:

- a frozen pretrained backbone left in train mode (the bug): its weight and bias never
  change, its running statistics drift;
- a target the program itself moves (BYOL's and MoCo's EMA/momentum encoder, a mean
  teacher, a DQN target network synced every k steps): its parameters do not require grad
  but take new values by ``lerp_``, ``mul_().add_()``, ``p.data = ...`` or
  ``load_state_dict``, and its batch norms run in train mode by design.

What tells them apart is the values. A layer's affine values (weight and bias: a few floats)
are kept when it is first flagged and compared with the current ones each later time it
is flagged: the first :data:`_EVERY` times, then on a doubling schedule (the 8th, 16th,
32nd ... time), so a target synced every k steps is seen moving within about 2k steps at a
cost of ``log2`` looks. A layer found unchanged is frozen (reported); one whose values moved
while still not requiring grad is updated by the program: never reported again, and a
finding already made is revised (:attr:`FrozenAffine.updated`). Each look costs one
comparison kernel per layer and one host read per device, for the flagged layers only.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

__all__ = ["FrozenAffine"]

_EVERY = 4  # looks made at every flagging; then only at the 8th, 16th, 32nd ... flagging


def _values(mod: nn.Module) -> Optional[torch.Tensor]:
    """The layer's own parameters flattened into one tensor (weight then bias), or ``None``
    when one of them requires grad now (unfrozen: no longer this question)."""
    params = list(mod.parameters(recurse=False))
    if not params or any(p.requires_grad for p in params):
        return None
    return torch.cat([p.detach().reshape(-1) for p in params])


def _due(looks: int) -> bool:
    """Compare at the first :data:`_EVERY` looks, then at powers of two."""
    return looks <= _EVERY or looks & (looks - 1) == 0


class FrozenAffine:
    """Per flagged norm layer: its affine values when first flagged, and the verdict so far.

    Example:
        >>> bn = nn.BatchNorm1d(3).requires_grad_(False)
        >>> fa = FrozenAffine()
        >>> fa.settled({"bn": weakref.ref(bn)}, ("bn",))  # held back at its first flagging
        ()
        >>> fa.settled({"bn": weakref.ref(bn)}, ("bn",))  # unchanged: frozen
        ('bn',)
        >>> with torch.no_grad():
        ...     _ = bn.weight.mul_(0.9)  # an EMA step moves it
        >>> fa.settled({"bn": weakref.ref(bn)}, ("bn",)), fa.updated
        ((), ('bn',))
    """

    def __init__(self) -> None:
        self._first: dict[str, torch.Tensor] = {}  # name -> affine values when first flagged
        self._looks: dict[str, int] = {}  # name -> times flagged since
        self._updated: dict[str, None] = {}  # names whose values the program moved (ordered)

    @property
    def updated(self) -> tuple[str, ...]:
        """The flagged layers found moved by the program (EMA, momentum, synced target)."""
        return tuple(self._updated)

    def settled(
        self, refs: dict[str, weakref.ref[nn.Module]], names: tuple[str, ...]
    ) -> tuple[str, ...]:
        """Of ``names`` (flagged this step), the layers to report: those found frozen. A
        layer is held back at its first flagging and dropped for good once its values moved."""
        kept: list[str] = []
        due: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name in names:
            if name in self._updated:
                continue
            ref = refs.get(name)
            mod = ref() if ref is not None else None
            now = _values(mod) if mod is not None else None
            if now is None:
                kept.append(name)  # gone or unfrozen: judged by its statistics alone
                continue
            first = self._first.get(name)
            if first is None:
                self._first[name] = now.clone()
                self._looks[name] = 0
                continue
            self._looks[name] += 1
            if _due(self._looks[name]):
                due.append((name, first, now))
            kept.append(name)
        moved = self._moved(due)
        if moved:
            for name in moved:
                self._updated[name] = None
                del self._first[name], self._looks[name]
            kept = [n for n in kept if n not in moved]
        return tuple(kept)

    @staticmethod
    def _moved(due: list[tuple[str, torch.Tensor, torch.Tensor]]) -> set[str]:
        """The names whose values differ from their first ones: the differences are reduced
        on each device and read in one transfer per device (not one sync per layer)."""
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, first, now in due:
            differs = (
                first.shape != now.shape or first.dtype != now.dtype or first.device != now.device
            )
            flag = torch.ones((), dtype=torch.bool) if differs else (first != now).any()
            by_device.setdefault(flag.device, []).append((name, flag))
        out: set[str] = set()
        for pairs in by_device.values():
            flags = torch.stack([f for _, f in pairs]).tolist()
            out.update(name for (name, _), hit in zip(pairs, flags) if hit)
        return out
