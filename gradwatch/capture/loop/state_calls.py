"""State changes the user asks of the watched model, and whether they still hold at the step.

While a watcher needs it, ``nn.Module`` methods are wrapped (one wrapper each for every
watcher, restored when the last one closes unless another library wrapped them since):

- ``train``: ``sub.eval()`` on a watched module below the root while the root trains (an
  intent that outlives the call: dropout off in an encoder), undone by an ancestor's
  ``train()`` before an optimizer step;
- ``requires_grad_``: ``sub.requires_grad_(False)`` below the root, undone by an ancestor's
  ``requires_grad_(True)`` before an optimizer step;
- ``to``, ``half``, ``float``, ``double``, ``bfloat16``, ``cuda``, ``cpu``: a dtype or device
  asked of a module below the root (``model.head.float()`` to keep the head in fp32), undone
  by an ancestor's blanket move (``model.half()``) before an optimizer step (what a call asks
  and what a module holds: :mod:`gradwatch.capture.loop.moves`).

``load_state_dict`` is wrapped from ``import gradwatch`` on (:mod:`gradwatch._loads`; here,
while watching, only when that is turned off): a ``strict=False`` load into a watched module
whose missing keys are trainable parameters the state dict holds under another name (a
``module.``/``model.``/``_orig_mod.`` prefix added or dropped, the same shape), or that
loaded no key at all. Loads made before the watcher began are taken when it starts and
judged at its first step by the same rule.

An undo counts only when it comes from an ancestor's blanket call before the module ran
a forward in the intended state, and the module's state at the step still differs from the
intent: ``sub.train()`` itself, a sample drawn with ``sub.eval()`` before ``model.train()``
restores it, unfreezing a few of its parameters by hand, ``model.head.float()`` after
``model.half()``, or a head cast and used before the model is cast, is a decision, not an
accident. While an intent waits, the module holds one forward pre-hook (removed at the
step). For a module no watcher holds each wrapper costs one dict lookup per watcher; the
user's line is read once per call that matters.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from gradwatch import _loads
from gradwatch.capture.forward.nan_probe import _Owned
from gradwatch.capture.loop import moves
from gradwatch.model.locations import call_site

__all__ = ["Intent", "Misload", "StateCalls"]

_listeners: list[weakref.ref[StateCalls]] = []
_saved: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # name: (theirs, ours)
_depth = [0]  # nested wrapped calls (an override of to() calling another move)
_MAX_PAIRS = 4  # examples of misnamed keys kept per load
_MOVES = ("dtype", "device")


@dataclass
class Misload:
    """A ``strict=False`` load whose missing trained weights the state dict held elsewhere."""

    module: str  # the watched module it was called on ("" the root)
    site: Optional[str]
    missing: list[str]  # trainable parameters it did not load
    pairs: list[tuple[str, str]]  # (model key, the state dict's key with that value)
    loaded: int  # keys it did load
    before_watch: bool = False  # made before the watcher began


@dataclass
class Intent:
    """A state asked of a module below the root, and its undoing: ``sub.eval()`` ("eval"),
    ``sub.requires_grad_(False)`` ("freeze"), a dtype or a device asked by a move."""

    kind: str  # "eval", "freeze", "dtype" or "device"
    module: str
    site: Optional[str]
    undone_by: Optional[str] = None  # the ancestor whose call undid it
    undone_at: Optional[str] = None  # that call's line
    used: bool = False  # the module ran a forward while the intent held: it took effect
    hook: Any = field(default=None, repr=False)  # the forward pre-hook that tells ``used``
    want: Any = None  # a move's torch.dtype or torch.device
    call: str = ""  # a move as asked (``float()``), and the one that undid it
    undo_call: str = ""
    at_step: list[str] = field(default_factory=list)  # a move's dtypes/devices at the step


class StateCalls:
    """One watcher's view of the state calls on its model (see the module docstring)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}  # id(module) -> its name in the watched model
        self.root: Optional[weakref.ref[nn.Module]] = None
        self.misloads: list[Misload] = []
        self.intents: dict[tuple[int, str], tuple[weakref.ref[nn.Module], Intent]] = {}
        self._on = False

    def watch(self, model: nn.Module) -> None:
        """Follow the modules of ``model`` (again at each layout sync); the first time, take
        the ``strict=False`` loads made into them before the watcher began."""
        self.names = {id(m): n for n, m in model.named_modules()}
        self.root = weakref.ref(model)
        if self._on:
            return
        self._on = True
        if not _listeners:
            _wrap()
        _listeners.append(weakref.ref(self))
        try:
            for load in _loads.take(lambda m: id(m) in self.names):
                module = load.module()
                if module is not None:
                    self.loaded(module, load, before_watch=True)
        except Exception:  # a finding is a nicety: never the watcher's start
            pass

    # -- what the wrappers tell --------------------------------------------------------------

    def loaded(self, module: nn.Module, load: _loads.Load, before_watch: bool = False) -> bool:
        """A ``strict=False`` load into ``module`` that left parameters missing: a misload
        when the missing trainable ones are held under other names or nothing loaded. True
        when ``module`` is this watcher's."""
        name = self.names.get(id(module))
        if name is None:
            return False
        params = dict(module.named_parameters())
        trained = [k for k in load.missing if k in params and params[k].requires_grad]
        pairs = [p for p in load.pairs if p[0] in params and params[p[0]].requires_grad]
        if trained and (pairs or load.loaded == 0):
            self.misloads.append(
                Misload(name, load.site, trained, pairs[:_MAX_PAIRS], load.loaded, before_watch)
            )
        return True

    def mode_or_freeze(
        self, module: nn.Module, kind: str, on: bool, site: Callable[[], Any]
    ) -> None:
        """``module.train(on)`` (kind "eval") or ``module.requires_grad_(not on)`` ("freeze")
        has just returned: ``on`` False sets an intent, True may undo others."""
        name = self.names.get(id(module))
        root = self.root() if self.root is not None else None
        if name is None or root is None:
            return
        if not on:
            if module is not root and (kind == "freeze" or root.training):
                self._intend(module, Intent(kind, name, site()))
            return
        for key, (ref, intent) in list(self.intents.items()):
            sub = ref()
            if intent.kind != kind or intent.undone_by is not None or sub is None:
                continue
            if sub is module or intent.used:
                self._drop(key)  # undone by itself, or after it took effect: a decision
            elif any(m is sub for m in module.modules()):
                intent.undone_by, intent.undone_at = name, site()
                intent.hook.remove()

    def moved(
        self,
        module: nn.Module,
        method: str,
        asked: Callable[[], dict[str, Any]],
        site: Callable[[], Any],
    ) -> None:
        """``module.<method>(...)`` (a device or dtype move) has just returned: it may undo
        the intents of its descendants, and below the root it sets its own."""
        name = self.names.get(id(module))
        root = self.root() if self.root is not None else None
        if name is None or root is None:
            return
        for key, (ref, intent) in list(self.intents.items()):
            sub = ref()
            if intent.kind not in _MOVES or intent.undone_by is not None or sub is None:
                continue
            if sub is module:
                continue  # moved again by itself: its new intent replaces this one
            if intent.used:
                self._drop(key)  # moved after it took effect: a decision
            elif any(m is sub for m in module.modules()) and not moves.holds(
                sub, intent.kind, intent.want
            ):
                intent.undone_by, intent.undone_at = name, site()
                intent.undo_call = moves.render(method, asked())
                intent.hook.remove()
        if module is root:
            return
        wanted = asked()
        for kind, want in wanted.items():
            self._intend(
                module,
                Intent(kind, name, site(), want=want, call=moves.render(method, wanted)),
            )

    def _intend(self, module: nn.Module, intent: Intent) -> None:
        key = (id(module), intent.kind)
        entry = self.intents.get(key)
        if entry is not None and intent.want is not None and entry[1].undone_by is None:
            if entry[1].want == intent.want:
                return  # asked again (a move in forward, each step): the one waiting stands
        self._drop(key)
        intent.hook = module.register_forward_pre_hook(_Owned(_used(intent), module))
        self.intents[key] = (weakref.ref(module), intent)

    def _drop(self, key: tuple[int, str]) -> None:
        entry = self.intents.pop(key, None)
        if entry is not None and entry[1].hook is not None:
            entry[1].hook.remove()

    # -- the step ----------------------------------------------------------------------------

    def take(self) -> tuple[list[Misload], list[Intent]]:
        """The misloads and the intents an ancestor undid that the step's state confirms;
        every intent is settled at the step (later changes are decisions)."""
        undone = []
        for ref, intent in self.intents.values():
            intent.hook.remove()
            sub = ref()
            if sub is not None and intent.undone_by is not None and _still_undone(sub, intent):
                undone.append(intent)
        self.intents.clear()
        out, self.misloads = self.misloads, []
        return out, undone

    def remove(self) -> None:
        if not self._on:
            return
        self._on = False
        for key in list(self.intents):
            self._drop(key)
        self.names = {}
        _listeners[:] = [r for r in _listeners if r() is not None and r() is not self]
        if not _listeners:
            _unwrap()


def _still_undone(sub: nn.Module, intent: Intent) -> bool:
    params = list(sub.parameters())
    if intent.kind == "eval":  # (a frozen module's statistics: frozen_stats_updated)
        return sub.training and any(p.requires_grad for p in params)
    if intent.kind == "freeze":
        return bool(params) and all(p.requires_grad for p in params)
    if moves.holds(sub, intent.kind, intent.want):
        return False
    intent.at_step = moves.state_of(sub, intent.kind)
    return True


def _used(intent: Intent) -> Callable[..., None]:
    def pre(module: nn.Module, args: Any) -> None:
        intent.used = True

    return pre


def _each(fn: Callable[[StateCalls], None]) -> None:
    for ref in list(_listeners):
        me = ref()
        if me is not None:
            fn(me)


def _held(module: nn.Module) -> bool:
    """Whether a watcher holds ``module``: the one question asked of every other module."""
    key = id(module)
    for ref in _listeners:
        me = ref()
        if me is not None and key in me.names:
            return True
    return False


def _sink(module: Any, load: _loads.Load) -> bool:
    """A load seen by :mod:`gradwatch._loads`: True when an open watcher holds the module."""
    held = False
    for ref in list(_listeners):
        me = ref()
        if me is not None and me.loaded(module, load):
            held = True
    return held


_loads.sinks.append(_sink)


def _site_once() -> Callable[[], Optional[str]]:
    got: list[Optional[str]] = []

    def site() -> Optional[str]:
        if not got:
            got.append(call_site())
        return got[0]

    return site


def _outer(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(self: nn.Module, flag: bool = True) -> Any:
        _depth[0] += 1
        try:
            out = fn(self, flag)
        finally:
            _depth[0] -= 1
        if _depth[0] == 0:
            try:
                site = _site_once()
                on = bool(flag)
                _each(lambda me: me.mode_or_freeze(self, kind, on, site))
            except Exception:
                pass
        return out

    return wrapped


def _mover(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        _depth[0] += 1
        try:
            out = fn(self, *args, **kwargs)
        finally:
            _depth[0] -= 1
        if _depth[0] == 0 and _held(self):
            try:
                site = _site_once()
                got: list[dict[str, Any]] = []

                def asked() -> dict[str, Any]:  # parsed only for a watched module
                    if not got:
                        got.append(moves.wants(method, args, kwargs))
                    return got[0]

                _each(lambda me: me.moved(self, method, asked, site))
            except Exception:  # a finding is a nicety: never the user's call
                pass
        return out

    return wrapped


def _wrap() -> None:
    wrappers = {
        "train": _outer("eval", nn.Module.train),
        "requires_grad_": _outer("freeze", nn.Module.requires_grad_),
    }
    for method in moves.METHODS:
        wrappers[method] = _mover(method, getattr(nn.Module, method))
    for name, fn in wrappers.items():
        _saved[name] = (getattr(nn.Module, name), fn)
        setattr(fn, "_gradwatch_state", True)  # noqa: B010 (a mark on a function object)
        setattr(nn.Module, name, fn)
    if not _loads.wrapped(nn.Module) and _loads.wrap(nn.Module):  # (GRADWATCH_RECORD_LOADS=0)
        _saved["load_state_dict"] = (nn.Module.load_state_dict, nn.Module.load_state_dict)


def _unwrap() -> None:
    """Put torch's own back, unless another library wrapped ours since (theirs stays; ours is
    known by identity: a ``functools.wraps`` over it copies its marks)."""
    if _saved.pop("load_state_dict", None) is not None:
        _loads.unwrap(nn.Module)
    for name in ("train", "requires_grad_", *moves.METHODS):
        entry = _saved.pop(name, None)
        if entry is not None and nn.Module.__dict__.get(name) is entry[1]:
            setattr(nn.Module, name, entry[0])
