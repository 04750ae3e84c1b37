"""The model and optimizers as built (SPEC section 7, source 1): ``model_as_built``.

Read at every layout sync (enter, ``add_optimizer``, ``add_param_group``, a replaced or
added layer), never on an ordinary step: modules registered at several sibling places,
parameters meant to be one that are two objects, each param group's hyperparameters and
the kinds of parameters it holds. The readers are plain functions of the model layer
(:mod:`gradwatch.model.sharing`, :mod:`gradwatch.model.hparams`); this source names what
they find the way findings do and hands the checks one :class:`BuiltModel` record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from gradwatch.model.engines import clean_name
from gradwatch.model.hparams import (
    DecayMiss,
    Degenerate,
    GroupInfo,
    decay_misses,
    degenerate,
    param_kinds,
    read_groups,
)
from gradwatch.model.sharing import (
    BrokenTie,
    SharedModule,
    declared_ties_broken,
    shared_modules,
    storage_aliases,
)
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["BuiltModel", "BuiltSource", "is_transformer"]


@dataclass(frozen=True)
class BuiltModel:
    """What the model and optimizers are, as built (one record per layout read)."""

    revision: int  # bumped at each read: a check judges each revision once
    shared: list[SharedModule] = field(default_factory=list)
    ties: list[BrokenTie] = field(default_factory=list)
    groups: list[GroupInfo] = field(default_factory=list)
    degenerate: list[Degenerate] = field(default_factory=list)
    decay: list[DecayMiss] = field(default_factory=list)
    transformer: bool = False
    sharded: bool = False  # a sharding engine's flat parameters: storages are not judged


def is_transformer(model: nn.Module) -> bool:
    """A model with attention layers (``nn.MultiheadAttention``, or a class named so)."""
    return any(
        isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower()
        for m in model.modules()
    )


class BuiltSource(EvidenceSource):
    name = "built"
    serves = frozenset({"model_as_built"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        self.built: Optional[BuiltModel] = None
        self._key: Optional[tuple[Any, ...]] = None

    def install(self) -> None:
        """Read the layout again when it is not the one read last (a sync may be a no-op)."""
        ctx = self.ctx
        model = ctx.model
        if model is None:
            return
        key = (
            tuple(map(id, model.parameters())),
            tuple(len(getattr(o, "param_groups", ())) for o in ctx.structure.optimizers),
            tuple(map(id, ctx.structure.optimizers)),
        )
        if key == self._key:
            return
        self._key = key
        self.built = self._read(model)

    def _name(self, p: torch.Tensor) -> str:
        index = self.ctx.structure.index
        i = index.lookup(p)
        return index.params[i].name if i is not None else f"<tensor of shape {list(p.shape)}>"

    def _read(self, model: nn.Module) -> BuiltModel:
        ctx = self.ctx
        sharded = ctx.sharded is not None
        groups = read_groups(ctx.structure.optimizers, param_kinds(model), self._name)
        transformer = is_transformer(model)
        ties = declared_ties_broken(model)
        if not sharded:  # FSDP's flat parameters are views of one storage by design
            named = ((clean_name(n), p) for n, p in model.named_parameters())
            ties = storage_aliases(named) + ties
        return BuiltModel(
            revision=(self.built.revision + 1) if self.built is not None else 0,
            shared=shared_modules(model),
            ties=ties,
            groups=groups,
            degenerate=degenerate(groups),
            decay=decay_misses(groups, transformer),
            transformer=transformer,
            sharded=sharded,
        )

    def record(self, state: StepState) -> Optional[BuiltModel]:
        return self.built
