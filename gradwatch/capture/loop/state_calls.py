"""State changes the user asks of the watched model, and whether they still hold at the step.

While a watcher needs it, three ``nn.Module`` methods are wrapped (one wrapper each for every
watcher, restored when the last one closes unless another library wrapped them since):

- ``load_state_dict``: a ``strict=False`` load into a watched module whose missing keys are
  trainable parameters the state dict holds under another name (a ``module.``/``model.``/
  ``_orig_mod.`` prefix added or dropped, the same shape), or that loaded no key at all;
- ``train``: ``sub.eval()`` on a watched module below the root while the root trains (an
  intent that outlives the call: dropout off in an encoder), undone by an ancestor's
  ``train()`` before an optimizer step;
- ``requires_grad_``: ``sub.requires_grad_(False)`` below the root, undone by an ancestor's
  ``requires_grad_(True)`` before an optimizer step.

An undo counts only when it comes from an ancestor's blanket call before the module ran
a forward in the intended state, and the module's state at the step still differs from the
intent: ``sub.train()`` itself, a sample drawn with ``sub.eval()`` before ``model.train()``
restores it, or unfreezing a few of its parameters by hand, is a decision, not an accident.
While an intent waits, the module holds one forward pre-hook (removed at the step). For a module no watcher holds each
wrapper costs one set lookup per watcher; the user's line is read once per call that
matters.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from gradwatch.capture.forward.nan_probe import _Owned
from gradwatch.model.locations import call_site

__all__ = ["Intent", "Misload", "StateCalls"]

_listeners: list[weakref.ref[StateCalls]] = []
_saved: dict[str, Callable[..., Any]] = {}
_depth = [0]  # nested wrapped calls (train() recurses through children)
_MAX_PAIRS = 4  # examples of misnamed keys kept per load


@dataclass
class Misload:
    """A ``strict=False`` load whose missing trained weights the state dict held elsewhere."""

    module: str  # the watched module it was called on ("" the root)
    site: Optional[str]
    missing: list[str]  # trainable parameters it did not load
    pairs: list[tuple[str, str]]  # (model key, the state dict's key with that value)
    loaded: int  # keys it did load


@dataclass
class Intent:
    """``sub.eval()`` or ``sub.requires_grad_(False)`` below the root, and its undoing."""

    kind: str  # "eval" or "freeze"
    module: str
    site: Optional[str]
    undone_by: Optional[str] = None  # the ancestor whose call undid it
    undone_at: Optional[str] = None  # that call's line
    used: bool = False  # the module ran a forward while the intent held: it took effect
    hook: Any = field(default=None, repr=False)  # the forward pre-hook that tells ``used``


def _match(missing: str, unexpected: list[str]) -> Optional[str]:
    """The unexpected key that is ``missing`` under a prefix added or dropped, if any."""
    tail = missing.split(".", 1)[1] if "." in missing else ""
    for u in unexpected:
        if u.endswith("." + missing) or missing.endswith("." + u):
            return u
        u_tail = u.split(".", 1)[1] if "." in u else ""
        if tail and u_tail == tail and tail.count(".") >= 1:  # one prefix swapped for another
            return u
    return None


class StateCalls:
    """One watcher's view of the state calls on its model (see the module docstring)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}  # id(module) -> its name in the watched model
        self.root: Optional[weakref.ref[nn.Module]] = None
        self.misloads: list[Misload] = []
        self.intents: dict[int, tuple[weakref.ref[nn.Module], Intent]] = {}
        self._on = False

    def watch(self, model: nn.Module) -> None:
        """Follow the modules of ``model`` (again at each layout sync)."""
        self.names = {id(m): n for n, m in model.named_modules()}
        self.root = weakref.ref(model)
        if self._on:
            return
        self._on = True
        if not _listeners:
            _wrap()
        _listeners.append(weakref.ref(self))

    # -- what the wrappers tell --------------------------------------------------------------

    def loaded(self, module: nn.Module, state: Any, result: Any) -> None:
        name = self.names.get(id(module))
        if name is None or not hasattr(result, "missing_keys"):
            return
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
        if not missing or len(state) == 0:
            return
        params = dict(module.named_parameters())
        trained = [k for k in missing if k in params and params[k].requires_grad]
        pairs: list[tuple[str, str]] = []
        for k in trained:
            u = _match(k, unexpected)
            v = state.get(u) if u is not None else None
            if u is not None and getattr(v, "shape", None) == params[k].shape:
                pairs.append((k, u))
        keys = set(module.state_dict().keys())
        loaded = len(keys) - len([k for k in missing if k in keys])
        if trained and (pairs or loaded == 0):
            self.misloads.append(Misload(name, call_site(), trained, pairs[:_MAX_PAIRS], loaded))

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
                self._drop(id(module))
                intent = Intent(kind, name, site())
                intent.hook = module.register_forward_pre_hook(_Owned(_used(intent), module))
                self.intents[id(module)] = (weakref.ref(module), intent)
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

    def _drop(self, key: int) -> None:
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
            if sub is None or intent.undone_by is None:
                continue
            params = list(sub.parameters())
            if intent.kind == "eval" and sub.training and any(p.requires_grad for p in params):
                undone.append(intent)  # (a frozen module's statistics: frozen_stats_updated)
            elif intent.kind == "freeze" and params and all(p.requires_grad for p in params):
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


def _used(intent: Intent) -> Callable[..., None]:
    def pre(module: nn.Module, args: Any) -> None:
        intent.used = True

    return pre


def _each(fn: Callable[[StateCalls], None]) -> None:
    for ref in list(_listeners):
        me = ref()
        if me is not None:
            fn(me)


def _site_once() -> Callable[[], Optional[str]]:
    got: list[Optional[str]] = []

    def site() -> Optional[str]:
        if not got:
            got.append(call_site())
        return got[0]

    return site


def _wrap() -> None:
    load = _saved["load_state_dict"] = nn.Module.load_state_dict
    train = _saved["train"] = nn.Module.train
    freeze = _saved["requires_grad_"] = nn.Module.requires_grad_

    def load_state_dict(
        self: nn.Module, state_dict: Any, strict: bool = True, *a: Any, **k: Any
    ) -> Any:
        result = load(self, state_dict, strict, *a, **k)
        if not strict and _depth[0] == 0:
            try:
                _each(lambda me: me.loaded(self, state_dict, result))
            except Exception:  # a finding is a nicety: never the user's load
                pass
        return result

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

    wrappers = {
        "load_state_dict": load_state_dict,
        "train": _outer("eval", train),
        "requires_grad_": _outer("freeze", freeze),
    }
    for name, fn in wrappers.items():
        setattr(fn, "_gradwatch_state", True)  # noqa: B010 (a mark on a function object)
        setattr(nn.Module, name, fn)


def _unwrap() -> None:
    """Put torch's own back, unless another library wrapped ours since (theirs stays)."""
    for name in ("load_state_dict", "train", "requires_grad_"):
        original = _saved.pop(name, None)
        if original is not None and getattr(getattr(nn.Module, name), "_gradwatch_state", False):
            setattr(nn.Module, name, original)
