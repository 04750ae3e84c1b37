"""The mode the model trains in: which mode-dependent modules ran in eval (or train) mode.

Read at the start of each outermost forward in grad mode (the forward scout's entry hook
calls :meth:`ModeWatch.seen`): a handful of ``module.training`` attribute reads over the
modules whose behaviour depends on it, picked once per layout (:meth:`ModeWatch.collect`):

- ``norm``: batch/instance norms that keep running statistics;
- ``dropout``: dropout modules with ``p > 0``;
- ``custom``: any other module whose class's ``forward`` reads ``self.training`` (stochastic
  depth, LayerDrop, attention dropout, gradient checkpointing switches).

Only those that matter are kept: a norm that holds trainable parameters, a dropout whose
parent holds or feeds trainable parameters, a custom module with trainable parameters in or
beside it. Frozen normalisation layers are kept apart: in eval they are correct (frozen on
purpose), in train their running statistics move (``frozen_stats_updated``).

What a training step saw is the latest forwards' state (:meth:`ModeWatch.take`): a forward
in another state replaces it, so a validation forward in eval mode under grad, followed by
``model.train()`` and a training forward, leaves no trace. No tensor is read, nothing syncs,
except for frozen norms flagged at a step: their affine values (a few floats, one host read
per device) tell a frozen layer from an EMA/momentum target (``_frozen_affine.py``).

Frozen batch norms are judged by their statistics, not by their mode at the forward's
start: a batch norm in train mode bumps the version counter of its ``num_batches_tracked``
at every call (``add_(1)``), one in eval never does. So a network that puts a frozen
sub-network in eval inside its own ``forward`` (a perceptual-loss backbone) is not flagged,
and one that puts it back in train there is. A norm without that counter (instance norm)
is judged by its mode at the forward's start.

Also here, read once per layout: freezing flags that PyTorch ignores (``module.requires_grad
= False``, ``trainable = False``, ``frozen = True``) on modules whose parameters still
require grad (``freeze_not_applied``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch import nn

from gradwatch.capture.forward._frozen_affine import FrozenAffine
from gradwatch.capture.forward.mode_calls import ModeCalls
from gradwatch.capture.grads.evidence import Tracker
from gradwatch.model.engines import clean_name
from gradwatch.model.named import NamedModels, member_of

__all__ = ["FLAG_ATTRS", "ModeSnapshot", "ModeWatch", "ignored_freeze_flags"]

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
_DROPOUTS = (nn.modules.dropout._DropoutNd, nn.AlphaDropout, nn.FeatureAlphaDropout)
_MAX_NAMED = 20  # modules named in one snapshot
#: Attribute -> the value that means "frozen", as frameworks other than PyTorch spell it.
FLAG_ATTRS: dict[str, bool] = {
    "requires_grad": False,
    "trainable": False,
    "frozen": True,
    "freeze": True,
    "is_frozen": True,
}


@dataclass(frozen=True)
class ModeSnapshot:
    """The mode state of the latest training forwards of a window."""

    root_eval: bool
    """The module the forward entered (the watched model) was in eval mode."""
    eval_modules: tuple[str, ...] = ()
    """Root in eval: the mode-dependent modules that matter, in eval. Otherwise: the topmost
    modules in eval (their parent in train) above such modules."""
    frozen_norms_training: tuple[str, ...] = ()
    """Normalisation layers with all affine parameters frozen, in train mode (stats move),
    whose affine values were found unchanged since their first flagging (frozen)."""
    eval_at_start: bool = False
    """The root was already in eval mode when watching began."""
    eval_sites: tuple[tuple[str, str], ...] = ()
    """(module in ``eval_modules``, or ``(root)``; the ``file:line`` that put it in eval
    mode), where gradwatch saw the ``eval()`` call (``capture/forward/mode_calls.py``)."""
    program_updated: tuple[str, ...] = ()
    """Frozen-looking norm layers whose affine values the program itself moved so far (an
    EMA/momentum target, a synced target network): not frozen (``_frozen_affine.py``)."""

    @property
    def clean(self) -> bool:
        return not self.root_eval and not self.eval_modules and not self.frozen_norms_training


@dataclass
class _Candidate:
    name: str
    ref: weakref.ref[nn.Module]
    kind: str  # norm / dropout / custom / frozen_norm
    parent: Optional[weakref.ref[nn.Module]]
    chain: list[tuple[str, weakref.ref[nn.Module]]] = field(default_factory=list)  # ancestors


def _counter_version(mod: Optional[nn.Module]) -> Optional[int]:
    """The version of a batch norm's ``num_batches_tracked`` (bumped by each train-mode call),
    or ``None`` where it has none."""
    counter = getattr(mod, "num_batches_tracked", None) if mod is not None else None
    if not isinstance(mod, nn.modules.batchnorm._BatchNorm) or counter is None:
        return None
    return int(counter._version)


def _reads_training(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and "training" in code.co_names


def _kind(mod: nn.Module) -> Optional[str]:
    if isinstance(mod, _NORMS):
        if not mod.track_running_stats or mod.running_mean is None or mod.momentum == 0:
            return None
        return "norm"
    if isinstance(mod, _DROPOUTS):
        return "dropout" if getattr(mod, "p", 0) > 0 else None
    cls = type(mod)
    if cls.__module__.startswith("torch.nn.") and cls is not nn.MultiheadAttention:
        return None  # PyTorch's own layers: only the ones above change with the mode
    if isinstance(mod, nn.MultiheadAttention) and mod.dropout == 0:
        return None
    return "custom" if _reads_training(cls) else None


def ignored_freeze_flags(
    model: nn.Module, trainable: Callable[[torch.Tensor], bool]
) -> list[tuple[str, str]]:
    """``(module name, attribute)`` of plain freezing flags PyTorch ignores on ``model``:
    the module's own ``__dict__`` holds ``requires_grad = False`` (or ``trainable = False``,
    ``frozen = True`` ...) while some of its parameters still require grad."""
    out: list[tuple[str, str]] = []
    for name, mod in model.named_modules():
        attrs = vars(mod)
        for attr, frozen in FLAG_ATTRS.items():
            if attrs.get(attr, not frozen) is frozen and any(map(trainable, mod.parameters())):
                out.append((clean_name(name) or "(root)", attr))
                break
    return out


class ModeWatch:
    """Module modes at each training forward (see the module docstring)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self._root: Optional[weakref.ref[nn.Module]] = None
        self._root_relevant = False  # the root's own forward reads self.training
        self._candidates: list[_Candidate] = []
        self._eval_at_start: Optional[bool] = None
        self._pending: Optional[ModeSnapshot] = None
        self._pending_seq = 0
        self._named = False  # several named models: each is a root of its own
        self._root_eval_seq = 0  # named models: the latest forward entered in a model in eval
        self._root_eval_snap: Optional[ModeSnapshot] = None
        self.flags: list[tuple[str, str]] = []
        self.calls = ModeCalls()  # where eval() was called on the watched modules
        # Frozen batch norms: ``num_batches_tracked``'s version when last read, and the event
        # number when it was last seen to change (their statistics moved).
        self._counted: dict[str, int] = {}
        self._moved_at: dict[str, int] = {}
        # Flagged frozen norms' affine values: an EMA/momentum target (BYOL, MoCo, mean
        # teacher) has requires_grad=False parameters the program itself moves; not frozen.
        self._affine = FrozenAffine()

    def collect(self, model: nn.Module, trainable: Callable[[torch.Tensor], bool]) -> None:
        """Pick the mode-dependent modules that matter (once per layout)."""
        if self._eval_at_start is None:
            self._eval_at_start = not model.training
        self._root = weakref.ref(model)
        self._named = isinstance(model, NamedModels)
        self.calls.watch(model)
        holds: dict[int, bool] = {}  # id(module) -> its subtree holds trainable params
        mods = dict(model.named_modules())
        for mod in mods.values():
            holds[id(mod)] = any(map(trainable, mod.parameters()))
        parents: dict[int, tuple[str, nn.Module]] = {}
        for name, mod in mods.items():
            for child in mod.children():
                parents.setdefault(id(child), (name, mod))
        self._root_relevant = _reads_training(type(model)) and holds[id(model)]
        out: list[_Candidate] = []
        for name, mod in mods.items():
            kind = _kind(mod) if mod is not model else None
            if kind is None:
                continue
            own = any(map(trainable, mod.parameters(recurse=False)))
            parent = parents.get(id(mod))
            beside = parent is not None and holds[id(parent[1])]
            if kind == "norm" and not own:
                own_params = list(mod.parameters(recurse=False))
                if not own_params or any(p.requires_grad for p in own_params):
                    continue  # no affine, or trained outside the watched optimizers
                kind = "frozen_norm"
            elif kind == "dropout" and not beside:
                continue
            elif kind == "custom" and not (holds[id(mod)] or beside):
                continue
            chain = []
            p = parent
            while p is not None and p[1] is not model:
                chain.append((clean_name(p[0]), weakref.ref(p[1])))
                p = parents.get(id(p[1]))
            ref = weakref.ref(parent[1]) if parent is not None else None
            out.append(_Candidate(clean_name(name), weakref.ref(mod), kind, ref, chain))
        self._candidates = out
        self.flags = ignored_freeze_flags(model, trainable)
        for c in out:
            version = _counter_version(c.ref()) if c.kind == "frozen_norm" else None
            if version is not None:
                self._counted.setdefault(c.name, version)

    def _note_moves(self) -> None:
        """Stamp the frozen batch norms whose statistics moved since they were last read."""
        for c in self._candidates:
            if c.kind != "frozen_norm" or c.name not in self._counted:
                continue
            version = _counter_version(c.ref())
            if version is not None and version != self._counted[c.name]:
                self._counted[c.name] = version
                self._moved_at[c.name] = self.tracker.now()

    def seen(self, entered: nn.Module) -> None:
        """An outermost forward in grad mode entered ``entered`` (the root, or a child of it)."""
        if not self._candidates and not self._root_relevant:
            return
        if self._counted:
            self._note_moves()
        root = self._root() if self._root is not None else None
        if self._named:
            # Named models (a GAN's G and D) are each a root the loop calls: one of them in
            # eval is a root in eval, even when the step's last forward entered another.
            snap = self._judge(not entered.training, self._member(root, entered))
            if snap.root_eval:
                self._root_eval_snap, self._root_eval_seq = snap, self.tracker.now()
        else:
            snap = self._judge(not entered.training or (root is not None and not root.training))
        if snap != self._pending:
            self._pending = snap
        self._pending_seq = self.tracker.now()

    @staticmethod
    def _member(root: Optional[nn.Module], entered: nn.Module) -> Optional[str]:
        """The name of the named model ``entered`` is (``None`` if it is none of them)."""
        if isinstance(root, NamedModels):
            for name in root.names:
                if root.model(name) is entered:
                    return name
        return None

    def _judge(self, root_eval: bool, member: Optional[str] = None) -> ModeSnapshot:
        evals: list[str] = []
        tops: dict[str, None] = {}
        frozen_training: list[str] = []
        for c in self._candidates:
            mod = c.ref()
            if mod is None or (member is not None and member_of(c.name) != member):
                continue  # gone, or in another named model than the one the forward entered
            if c.kind == "frozen_norm":
                if c.name in self._counted:  # judged by its statistics (take)
                    continue
                if mod.training and not root_eval:
                    frozen_training.append(c.name)
                continue
            if mod.training:
                continue
            if root_eval:
                evals.append(c.name)
                continue
            parent = c.parent() if c.parent is not None else None
            if c.kind == "norm" and (parent is None or parent.training):
                continue  # a norm put in eval on its own: statistics frozen on purpose
            top = c.name
            for name, ref in c.chain:  # the topmost ancestor in eval (its parent in train)
                anc = ref()
                if anc is None or anc.training:
                    break
                top = name
            tops[top] = None
        if root_eval and (evals or self._root_relevant):
            named = tuple(evals[:_MAX_NAMED]) or ("(root)",)
            root = self._root() if self._root is not None else None
            if member is not None and isinstance(root, NamedModels):
                root = root.model(member)  # the named model in eval: where its eval() was
            site = self.calls.eval_site(root)
            sites = (("(root)", site),) if site else ()
            return ModeSnapshot(True, named, (), bool(self._eval_at_start), sites)
        named = tuple(list(tops)[:_MAX_NAMED])
        return ModeSnapshot(
            False,
            named,
            tuple(frozen_training[:_MAX_NAMED]),
            bool(self._eval_at_start),
            self._sites(named),
        )

    def _sites(self, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        """Where each of ``names`` (modules in eval under a training root) was put in eval."""
        if not names:
            return ()
        by_name = {c.name: c.ref for c in self._candidates}
        for c in self._candidates:
            by_name.update(c.chain)
        out = []
        for name in names:
            ref = by_name.get(name)
            site = self.calls.eval_site(ref() if ref is not None else None)
            if site:
                out.append((name, site))
        return tuple(out)

    def remove(self) -> None:
        """Stop following ``train()`` calls (the watcher closes)."""
        self.calls.remove()

    def take(self, start: int) -> Optional[ModeSnapshot]:
        """The state of the latest training forwards, if one ran since event ``start``."""
        if self._pending is None or self._pending_seq <= start:
            return None
        if self._root_eval_snap is not None and self._root_eval_seq > start:
            return self._root_eval_snap  # a named model in eval (a root) ran since ``start``
        names = self._pending.frozen_norms_training
        if self._counted:
            self._note_moves()
            moved = [n for n, seq in self._moved_at.items() if seq > start]
            names = tuple(dict.fromkeys([*names, *moved]))
        if not names:
            return self._pending
        refs = {c.name: c.ref for c in self._candidates}
        settled = self._affine.settled(refs, names)
        return replace(
            self._pending,
            frozen_norms_training=settled[:_MAX_NAMED],
            program_updated=self._affine.updated[:_MAX_NAMED],
        )
