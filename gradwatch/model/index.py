"""Which parameters a watcher knows: names (tied ones once, with every name), owning layers.

A *layer* is a module that directly owns parameters. A parameter shared by several modules
(tied weights) is one entry owned by every one of them; its layer for statistics is the first.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from gradwatch.model.engines import clean_name

ROOT = "(root)"


@dataclass
class ParamInfo:
    """One distinct parameter tensor."""

    idx: int
    names: list[str]
    layer: str
    owners: list[str]
    numel: int
    ref: weakref.ref[torch.Tensor]
    outside_model: bool = False
    hooked: bool = False
    hooked_at: int = -1  # event counter value when its hooks were registered
    within: Optional[int] = None
    """FSDP1 flattened: the flat parameter holding this one (no tensor of its own, never
    hooked; ``ref`` is the flat parameter's, see :mod:`gradwatch.distributed.fsdp1_flat`)."""

    @property
    def name(self) -> str:
        return self.names[0]


# Parameter's metaclass answers isinstance() in Python (~0.4 us); most parameters are of
# these exact types, which a type() lookup settles in C (checked on every statistics step).
_PLAIN_TYPES = frozenset({nn.Parameter, torch.Tensor})


def _is_uninitialized(p: torch.Tensor) -> bool:
    return type(p) not in _PLAIN_TYPES and isinstance(p, nn.parameter.UninitializedParameter)


@dataclass
class ParamIndex:
    """An append-only registry of parameters keyed by tensor identity."""

    params: list[ParamInfo] = field(default_factory=list)
    layers: dict[str, list[int]] = field(default_factory=dict)
    _by_id: dict[int, int] = field(default_factory=dict)
    _names: dict[tuple[int, ...], list[str]] = field(default_factory=dict)
    optimizer_names: list[Optional[str]] = field(default_factory=list)
    """Per watched optimizer, the name the user gave it (``watch(..., {"G": opt_g})``)."""

    def optimizer_label(self, k: Optional[int]) -> str:
        """How findings name optimizer ``k``: ``optimizer['G']`` when named, else
        ``optimizer[0]``."""
        name = self.optimizer_names[k] if k is not None and k < len(self.optimizer_names) else None
        return f"optimizer[{name!r}]" if name is not None else f"optimizer[{k}]"

    def lookup(self, p: torch.Tensor) -> Optional[int]:
        """The index of ``p`` when it is registered (identity, not value)."""
        i = self._by_id.get(id(p))
        if i is not None and self.params[i].ref() is p:
            return i
        return None

    def _register(self, p: torch.Tensor, name: str, owner: str, outside: bool = False) -> int:
        i = self.lookup(p)
        if i is not None:
            info = self.params[i]
            if name not in info.names:
                info.names.append(name)
                self._names.clear()
            if owner not in info.owners:
                info.owners.append(owner)
            return i
        i = len(self.params)
        numel = 0 if _is_uninitialized(p) else p.numel()
        self.params.append(ParamInfo(i, [name], owner, [owner], numel, weakref.ref(p), outside))
        self._by_id[id(p)] = i
        self.layers.setdefault(owner, []).append(i)
        return i

    def scan_model(self, model: nn.Module) -> list[int]:
        """Register every parameter of ``model`` (all names of tied ones); return new indices."""
        before = len(self.params)
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                # the user's names, not a wrapper's; a named model's root "G:" -> "G:weight"
                full = clean_name(f"{mod_name}.{pname}" if mod_name else pname)
                self._register(p, full, clean_name(_layer_of(mod_name, mod)) or ROOT)
        for info in self.params:
            if info.numel == 0:
                p = info.ref()
                if p is not None and not _is_uninitialized(p):
                    info.numel = p.numel()
        return list(range(before, len(self.params)))

    def register_foreign(self, p: torch.Tensor, name: str) -> int:
        """Register an optimizer tensor that is not in the watched model under ``name``."""
        group = name.rsplit("[", 1)[0]
        return self._register(p, name, group, outside=True)

    def register_within(
        self, flat: int, names: list[str], layer: str, owners: list[str], numel: int
    ) -> int:
        """Register an original parameter that lives as a slice of flat parameter ``flat``."""
        i = len(self.params)
        info = ParamInfo(i, list(names), layer, list(owners), numel, self.params[flat].ref)
        info.within = flat
        self.params.append(info)
        for owner in owners:
            self.layers.setdefault(owner, []).append(i)
        self._names.clear()
        return i

    def hide(self, i: int, names: list[str]) -> None:
        """Take parameter ``i`` out of the layers (its originals stand for it in the report);
        a finding that still names it (a layout one) lists the originals' ``names``."""
        self.params[i].names = list(names)
        self._names.clear()
        for owner in self.params[i].owners:
            ids = self.layers.get(owner)
            if ids is not None and i in ids:
                ids.remove(i)
                if not ids:
                    del self.layers[owner]

    def live(self) -> Iterator[tuple[ParamInfo, torch.Tensor]]:
        """Registered parameters that still exist (slices of a flat parameter excluded)."""
        for info in self.params:
            p = info.ref()
            if p is not None and info.within is None:
                yield info, p

    def names(self, idxs: list[int]) -> list[str]:
        """Every name of every index, in order, without repeats (a fresh list)."""
        key = tuple(idxs)
        found = self._names.get(key)
        if found is None:
            # A dict keeps the order and tests membership in O(1): a list made 30k tensors of
            # one ParameterList quadratic (15 s at exit).
            found = list(dict.fromkeys(n for i in idxs for n in self.params[i].names))
            if len(self._names) > 4096:
                self._names.clear()
            self._names[key] = found
        return list(found)

    @staticmethod
    def uninitialized(p: torch.Tensor) -> bool:
        return _is_uninitialized(p)

    @staticmethod
    def any_uninitialized(params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params`` is a lazy parameter without values yet.

        One C-level pass over the types in the usual case (every parameter a plain one):
        this runs on every statistics step, over every parameter.
        """
        types = set(map(type, params))
        return not types <= _PLAIN_TYPES and any(
            issubclass(t, nn.parameter.UninitializedParameter) for t in types
        )


def _layer_of(mod_name: str, mod: nn.Module) -> str:
    """The layer that owns ``mod``'s parameters: a parametrization's ``original``
    (``spectral_norm``, ``weight_norm``, ``orthogonal``) belongs to the module it
    parametrizes, with its bias: judged alone, a hinge GAN's last bias (whose gradient
    cancels exactly) read as a whole layer gone dead."""
    if isinstance(mod, parametrize.ParametrizationList) and ".parametrizations." in mod_name:
        return mod_name.rsplit(".parametrizations.", 1)[0]
    if isinstance(mod, parametrize.ParametrizationList) and mod_name.startswith(
        "parametrizations."
    ):
        return ""
    return mod_name
