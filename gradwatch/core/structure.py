"""The parameter/optimizer layout: which parameters are watched, by which optimizer.

:meth:`Structure.sync` scans the model and the optimizers' groups, hooks what is new and
regroups the per-optimizer :class:`Track` s only when the layout really changed; checks get
a :class:`~gradwatch.checks.StructureView` then.
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Any, Optional

import torch
from torch import nn

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.hooks import HookSet
from gradwatch.capture.grads.window import Track
from gradwatch.checks.views import StructureView
from gradwatch.measure import carry, carry_groups
from gradwatch.model import registry
from gradwatch.model.index import ParamIndex
from gradwatch.model.library import library_owned

_requires_grad = attrgetter("requires_grad")

__all__ = ["Structure"]


class Structure:
    """The watched layout of one model and its optimizers."""

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        tracker: Tracker,
        *,
        ddp_find_unused: Optional[bool] = None,
        names: Optional[list[Optional[str]]] = None,
    ) -> None:
        self.index = ParamIndex()
        self.optimizers = optimizers
        self.index.optimizer_names = list(names) if names else [None] * len(optimizers)
        self.tracker = tracker
        self.tracks: list[Track] = []
        self.coverage: dict[str, int] = {}
        self.outside: list[int] = []  # optimizer tensors that are not the model's parameters
        self._key: Any = None
        self._model_signature: tuple[int, ...] = ()
        self._lazy: list[weakref.ref[torch.Tensor]] = []
        # The DDP wrapper's find_unused_parameters (None: not under a DDP wrapper we saw).
        self.ddp_find_unused = ddp_find_unused
        self._frozen: list[weakref.ref[torch.Tensor]] = []  # frozen at the last scan
        self._generation = -1  # registry.generation() at the last scan
        registry.acquire()  # count registrations: layout changes without a walk per step
        self._counting = True

    def track_of(self, k: Optional[int]) -> Optional[Track]:
        """The track of optimizer ``k`` (``None``: the backward-pass track)."""
        return next((t for t in self.tracks if t.index == k), None)

    def sync(self, model: nn.Module, hooks: HookSet, step: int) -> Optional[StructureView]:
        """Scan ``model``, hook new parameters and layers; a view when the layout changed."""
        index = self.index
        self._generation = registry.generation()
        index.scan_model(model)
        self._model_signature = tuple(map(id, model.parameters()))
        optimizer_of: dict[int, list[int]] = {}
        for k, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    i = index.lookup(p)
                    if i is None:
                        name = f"{index.optimizer_label(k)}.group[{g}][{j}]"
                        i = index.register_foreign(p, name)
                    optimizer_of.setdefault(i, []).append(k)
        self.tracker.grow(len(index.params))
        trainable, frozen = [], []
        self._lazy = []
        for info, p in index.live():
            if index.uninitialized(p):
                # No hook fits an uninitialised parameter: it is judged (it cannot have a
                # gradient) and hooked at the first backward end after it materialises.
                self._lazy.append(info.ref)
                if p.requires_grad:
                    trainable.append(info.idx)
                continue
            if p.requires_grad:
                trainable.append(info.idx)
                hooks.hook_param(info.idx, p)
            else:
                frozen.append(info.idx)
        hooks.hook_modules(model)
        self._frozen = [index.params[i].ref for i in frozen]
        key = (tuple(trainable), tuple(sorted(optimizer_of)), len(index.params))
        if self.tracks and key == self._key:
            return None
        self._key = key
        self._rebuild_tracks(trainable, optimizer_of, frozen)
        self.outside = [i for i in optimizer_of if index.params[i].outside_model]
        self.coverage = _coverage(index, trainable, frozen, optimizer_of, self.optimizers)
        return StructureView(
            index,
            trainable,
            frozen,
            set(optimizer_of),
            optimizer_of,
            bool(self.optimizers),
            extra={
                "step": step,
                "ddp_find_unused": self.ddp_find_unused,
                "optimizer_classes": [type(o).__name__ for o in self.optimizers],
                "library_owned": library_owned(model),
                "padded_embeddings": padded_embeddings(model),
            },
        )

    def _rebuild_tracks(
        self, trainable: list[int], optimizer_of: dict[int, list[int]], frozen: list[int]
    ) -> None:
        index = self.index
        old = {t.index: t for t in self.tracks}
        groups: list[tuple[Optional[int], list[int]]]
        if self.optimizers:
            groups = [
                (k, [i for i in trainable if k in optimizer_of.get(i, ())])
                for k in range(len(self.optimizers))
            ]
        else:
            groups = [(None, trainable)]
        tracks = []
        for k, ids in groups:
            track = old.get(k) or Track(index=k, start=self.tracker.now())
            if k is not None:
                opt = self.optimizers[k]
                track.ref = weakref.ref(opt)
                track.signature = group_signature(opt)
            params = [index.params[i].ref() for i in ids]
            live = [(i, p) for i, p in zip(ids, params) if p is not None]
            track.set_params(
                [i for i, _ in live], [p for _, p in live], [index.params[i].layer for i, _ in live]
            )
            held = [(i, index.params[i].ref()) for i in frozen if k in optimizer_of.get(i, ())]
            track.set_frozen([(i, p) for i, p in held if p is not None])
            track.fingerprint = track.frozen_fp = None
            tracks.append(track)
        self.tracks = tracks

    def add_optimizer(self, opt: torch.optim.Optimizer, name: Optional[str]) -> int:
        """Watch ``opt`` from now on (its track starts at the next sync); its index."""
        self.optimizers.append(opt)
        self.index.optimizer_names.append(name)
        return len(self.optimizers) - 1

    def lazy_materialised(self) -> bool:
        """Whether a lazy parameter got its values since the last sync."""
        live = (r() for r in self._lazy)
        return any(not ParamIndex.uninitialized(p) for p in live if p is not None)

    def may_have_changed(self, model: nn.Module) -> bool:
        """Parameters added to / replaced in the model, or one frozen or unfrozen (cheap).

        No walk of the module tree unless a module or parameter was registered somewhere
        since the last scan (:mod:`gradwatch.model.registry`); the ``requires_grad`` flips
        are read from the tracked lists.
        """
        gen = registry.generation()
        if gen != self._generation:
            if tuple(map(id, model.parameters())) != self._model_signature:
                return True
            self._generation = gen  # a registration elsewhere: this model is unchanged
        if not all(all(map(_requires_grad, t.params)) for t in self.tracks):
            return True  # frozen since the last scan
        return any(p is not None and p.requires_grad for p in (r() for r in self._frozen))

    def release(self) -> None:
        """Drop every reference to parameters and their copies (the watcher closed)."""
        carry_groups.forget()  # readings of this run's tensors: of no use after it
        carry.forget()
        self.optimizers = []
        self._frozen = []
        for track in self.tracks:
            track.params, track.fingerprint, track.ref = [], None, None
            track.set_frozen([])
            track.frozen_fp = None
        if self._counting:
            self._counting = False
            registry.release()


def group_signature(opt: torch.optim.Optimizer) -> tuple[int, ...]:
    """The sizes of ``opt``'s parameter groups: a change means a new layout."""
    return tuple(len(g["params"]) for g in opt.param_groups)


def _coverage(
    index: ParamIndex,
    trainable: list[int],
    frozen: list[int],
    optimizer_of: dict[int, list[int]],
    optimizers: list[torch.optim.Optimizer],
) -> dict[str, int]:
    params = index.params
    unoptimised = sum(1 for i in trainable if i not in optimizer_of and not params[i].outside_model)
    return dict(
        trainable=len(trainable),
        frozen=len(frozen),
        trainable_numel=sum(params[i].numel for i in trainable),
        frozen_numel=sum(params[i].numel for i in frozen),
        in_optimizer=sum(1 for i in trainable if i in optimizer_of),
        not_in_optimizer=unoptimised if optimizers else 0,
        frozen_in_optimizer=sum(1 for i in frozen if i in optimizer_of),
        outside_model=sum(1 for i in optimizer_of if params[i].outside_model),
        optimizers=len(optimizers),
    )


def padded_embeddings(model: nn.Module) -> list[str]:
    """The embedding tables with a ``padding_idx``: fed only that index, torch's documented
    gradient is exactly zero (``dead_param`` leaves them out)."""
    kinds = (nn.Embedding, nn.EmbeddingBag)
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, kinds) and getattr(m, "padding_idx", None) is not None
    ]
