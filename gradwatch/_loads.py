"""``load_state_dict(strict=False)`` calls kept from import, for a watcher's first step to judge.

``call_without_effect`` judges a ``strict=False`` load whose missing keys are trained
weights. Its most common form comes before any watcher exists::

    model.load_state_dict(ckpt, strict=False)  # a `module.`-prefixed checkpoint: loads nothing
    with gradwatch.watch(model, opt): ...

So from ``import gradwatch`` on, ``nn.Module.load_state_dict`` is wrapped once, for the
process: at once when torch is already imported, else right after ``import torch`` finishes
(a one-shot import hook on ``sys.meta_path`` that wraps the loader of ``torch`` and leaves;
``import gradwatch`` still does not import torch). ``GRADWATCH_RECORD_LOADS=0`` turns it off;
watchers then wrap the method while they are open, as before.

The wrapper is transparent: torch's method (or whatever stood there, another library's wrapper
included) is called first with the caller's arguments, its return value and exceptions pass
unchanged, ``functools.wraps`` keeps its name, doc and signature (``inspect.signature``
follows ``__wrapped__``), and a wrapper installed later over this one keeps working because
each calls the one it found. A ``strict=True`` load costs one look at the arguments. After a
``strict=False`` load that left parameters missing (once, not per watcher):
:func:`analyse` names them, pairs each with a state dict key that holds it under another
prefix (the same shape) and counts what was loaded; an open watcher that holds the module
takes that result (a sink, :mod:`gradwatch.capture.loop.state_calls`), otherwise it is kept:
a weak reference to the module, parameter names and the call's line, no tensor, the last
:data:`KEEP` only. A watcher takes the records of its model's modules when it starts
(:func:`take`) and judges them at its first step by the rules of a load made while watching.

This module imports no torch: the import hook runs inside torch's own import.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["KEEP", "Load", "analyse", "arm", "take", "unwrap", "wrap"]

KEEP = 16  # loads kept that no watcher took (the newest win)
ENV = "GRADWATCH_RECORD_LOADS"


@dataclass
class Load:
    """A ``strict=False`` load that left parameters of ``module`` missing."""

    module: weakref.ref[Any]
    site: Optional[str]  # the user's line
    missing: list[str]  # parameters it did not load (trainable or not: judged at the step)
    pairs: list[tuple[str, str]]  # (parameter, the state dict's key holding it, same shape)
    loaded: int  # keys of the module's state dict it did load


_records: deque[Load] = deque(maxlen=KEEP)
sinks: list[Callable[[Any, Load], bool]] = []  # open watchers: True when one held the module
_installed: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # cls: (ours, theirs)
_busy = [0]  # a load inside a load (an override calling its children's): the outer one counts


def _matcher(unexpected: list[str]) -> Callable[[str], Optional[str]]:
    """For a missing key, the unexpected key that is it under a prefix added, dropped or
    swapped (``module.x.w`` / ``x.w``; ``model.x.w`` / ``net.x.w``), in one pass over the keys."""
    exact = set(unexpected)
    by_suffix: dict[str, str] = {}  # every dot-suffix of an unexpected key -> that key
    by_tail: dict[str, str] = {}  # an unexpected key without its first part -> that key
    for u in unexpected:
        parts = u.split(".")
        for i in range(1, len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), u)
        if len(parts) > 2:
            by_tail.setdefault(".".join(parts[1:]), u)

    def find(missing: str) -> Optional[str]:
        u = by_suffix.get(missing)  # a prefix added in the state dict
        if u is not None:
            return u
        parts = missing.split(".")
        for i in range(1, len(parts)):  # a prefix dropped in the state dict
            if ".".join(parts[i:]) in exact:
                return ".".join(parts[i:])
        return by_tail.get(".".join(parts[1:])) if len(parts) > 2 else None  # one swapped

    return find


def analyse(module: Any, state: Any, result: Any) -> Optional[Load]:
    """What a finished ``module.load_state_dict(state, strict=False)`` left undone, or None
    when it cannot be a misload: no parameter missing (a buffer, an empty state dict), or
    none held under another name while something loaded."""
    missing = list(getattr(result, "missing_keys", ()))
    if not missing or len(state) == 0:
        return None
    params = dict(module.named_parameters())
    names = [k for k in missing if k in params]
    if not names:
        return None
    find = _matcher(list(result.unexpected_keys))
    pairs: list[tuple[str, str]] = []
    for k in names:
        u = find(k)
        if u is not None and getattr(state.get(u), "shape", None) == params[k].shape:
            pairs.append((k, u))
    keys = set(module.state_dict().keys())
    loaded = len(keys) - len([k for k in missing if k in keys])
    if not pairs and loaded:
        return None  # a fine-tuning load (a new head missing): never a misload
    from gradwatch.model.locations import call_site  # torch is imported by now

    return Load(weakref.ref(module), call_site(), names, pairs, loaded)


def _after(module: Any, state: Any, result: Any) -> None:
    load = analyse(module, state, result)
    if load is None:
        return
    held = [sink(module, load) for sink in list(sinks)]
    if not any(held):
        _records.append(load)


def take(held: Callable[[Any], bool]) -> list[Load]:
    """The kept loads into live modules for which ``held(module)`` is true, taken out (a
    watcher opened again on the same model does not judge them twice)."""
    out: list[Load] = []
    keep: list[Load] = []
    for load in _records:
        module = load.module()
        if module is None:
            continue
        (out if held(module) else keep).append(load)
    _records.clear()
    _records.extend(keep)
    return out


def _wrapper(theirs: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(theirs)
    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        _busy[0] += 1
        try:
            result = theirs(*args, **kwargs)
        finally:
            _busy[0] -= 1
        strict = kwargs.get("strict", args[2] if len(args) > 2 else True)
        if not strict and _busy[0] == 0:
            try:
                state = kwargs["state_dict"] if "state_dict" in kwargs else args[1]
                _after(args[0], state, result)
            except Exception:  # a finding is a nicety: never the user's load
                pass
        return result

    return load_state_dict


def wrap(cls: Any) -> bool:
    """Wrap ``cls.load_state_dict`` (``nn.Module``); False when it is ours already."""
    theirs = cls.__dict__.get("load_state_dict")
    if theirs is None or (cls in _installed and _installed[cls][0] is theirs):
        return False
    ours = _wrapper(theirs)
    _installed[cls] = (ours, theirs)
    cls.load_state_dict = ours
    return True


def unwrap(cls: Any) -> None:
    """Put back what ``wrap`` found, unless another library wrapped ours since (theirs stays,
    and ours inside it keeps working)."""
    entry = _installed.pop(cls, None)
    if entry is not None and cls.__dict__.get("load_state_dict") is entry[0]:
        cls.load_state_dict = entry[1]


def wrapped(cls: Any) -> bool:
    """Whether this module's wrapper is installed on ``cls`` (on top, or under another
    library's wrapper that calls the one it found): a watcher must not wrap it again, which
    would replace the record of the process-wide one and, at exit, drop it."""
    return cls in _installed


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``torch``, lets the other finders find it and wraps the
    loader's ``exec_module`` so that ``nn.Module`` is wrapped once torch's ``__init__`` has
    run; then it leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        try:
            return self._spec(fullname, path, target)
        except Exception:
            return None  # the ordinary import goes on without us

    def _spec(self, fullname: str, path: Any, target: Any) -> Any:
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            try:
                run(module)
            finally:
                _leave(self)
                try:
                    del loader.exec_module  # the loader's own method again
                except AttributeError:
                    pass
            try:
                wrap(module.nn.Module)
            except Exception:
                pass

        loader.exec_module = exec_module  # this spec's loader only
        return spec


def _leave(finder: _AfterTorch) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def arm() -> None:
    """Start keeping ``strict=False`` loads (``import gradwatch`` calls it)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    torch = sys.modules.get("torch")
    if torch is None:
        if not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterTorch())
        return
    module = getattr(getattr(torch, "nn", None), "Module", None)
    if module is not None:  # (else torch is half imported: watchers wrap it while open)
        try:
            wrap(module)
        except Exception:
            pass
