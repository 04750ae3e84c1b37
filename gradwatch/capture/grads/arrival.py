"""Each parameter's arrival hook: on, off while the step reads its arrival, back on.

A post-accumulate hook, or, where :attr:`ArrivalHooks.light` and only while the step may
come to read the parameter (the first steps; a read parameter hooked in turn), a tensor
pre-hook that defers the post hook's work (``capture/grads/deferred.py``): torch keeps
calling a removed post hook's emptied dict for good, a pre-hook's it drops. Hooks that stay
on for good become post hooks (:meth:`ArrivalHooks.settle`): a light one costs two calls.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.deferred import Deferred
from gradwatch.capture.grads.evidence import task_id
from gradwatch.capture.grads.tensor_hooks import put_back, register_light, release_pre_hooks

__all__ = ["ArrivalHooks"]


class ArrivalHooks:
    """The arrival hooks of one watcher (``HookSet`` holds the value-check pre-hooks)."""

    def __init__(
        self,
        on_error: Callable[[str, BaseException], None],
        pre: dict[int, RemovableHandle],
        refs: dict[int, weakref.ref[torch.Tensor]],
    ) -> None:
        self.param: dict[int, RemovableHandle] = {}  # hooked now
        self.unhooked: set[int] = set()  # off: the step reads their arrival
        self._off: dict[int, RemovableHandle] = {}  # removed post hooks, put back by rehook
        self._pre = pre  # the value checks on now (the HookSet's)
        self._refs = refs
        self._post_fns: dict[int, Any] = {}
        # One device, no engine, not compiled (set by the watcher): hooks that may come off
        # are light.
        self.light = False
        self.deferred = Deferred(on_error)
        self.deferred.settle_first = functools.partial(self.settle, first=True)
        self.lit: set[int] = set()  # parameters whose arrival hook is light now
        self._light_fns: dict[int, Any] = {}
        self._unreleased: set[int] = set()  # emptied pre-hook dicts to drop outside backward

    def hook(self, i: int, p: torch.Tensor, post: Callable[[torch.Tensor], None]) -> None:
        """Parameter ``i``'s arrival hook, ``post`` its work; light unless someone else's
        post hook is there (an optimizer stepped in backward)."""
        self._post_fns[i] = post
        self._hook(i, p, self._may_be_light(p))

    def _may_be_light(self, p: torch.Tensor) -> bool:
        """Light hooks allowed, and no one else's post hook on ``p`` to go after."""
        return self.light and not p._post_accumulate_grad_hooks

    def _hook(self, i: int, p: torch.Tensor, light: bool) -> None:
        if light:
            fn = self._light_fns.get(i)
            if fn is None:
                fn = self._light_fns[i] = self.deferred.make(i, self._refs[i], self._post_fns[i])
            self.param[i] = register_light(p, fn)
            self.lit.add(i)
            self._unreleased.discard(i)
        else:
            self.param[i] = p.register_post_accumulate_grad_hook(self._post_fns[i])

    def settle(self, i: int, first: bool = False) -> None:
        """Parameter ``i``'s light arrival hook becomes a post hook for good (``first``: ahead
        of the others' post hooks, from inside its own pre-hook: it fires this time)."""
        p = self._refs[i]() if i in self.lit and i in self.param else None
        if p is None or not p.requires_grad:  # frozen: nothing fires until it trains again
            return
        self.lit.discard(i)
        self.param.pop(i).remove()
        self._release(i)
        self.param[i] = p.register_post_accumulate_grad_hook(self._post_fns[i])
        hooks = p._post_accumulate_grad_hooks
        if first and isinstance(hooks, OrderedDict):
            hooks.move_to_end(self.param[i].id, last=False)

    def settle_all(self, ids: Iterable[int], keep: Collection[int] = ()) -> None:
        """Every light arrival hook of ``ids`` but ``keep``'s becomes a post hook."""
        extra = self.lit.difference(keep)
        if extra:
            for i in extra.intersection(ids):
                self.settle(i)

    def unhook(self, i: int) -> None:
        """Parameter ``i``'s arrival hook off: the step reads its arrival instead."""
        handle = self.param.pop(i, None)
        if handle is not None:
            handle.remove()
            self.unhooked.add(i)
            if i in self.lit:
                self.lit.discard(i)
                self._release(i)
            else:
                self._off[i] = handle

    def rehook(self, i: int, light: bool = False) -> None:
        """Parameter ``i``'s arrival hook back on (whole windows count from the next one):
        ``light`` where it comes off again soon (hooked in turn), else a post hook."""
        if i in self.param:
            if not light:
                self.settle(i)
            return
        p = self._refs[i]() if i in self.unhooked else None
        if p is None:
            self.unhooked.discard(i)  # gone with its tensor
            self._off.pop(i, None)
        elif p.requires_grad:  # a frozen one gets its hook back when it trains again
            self.unhooked.discard(i)
            if light and self._may_be_light(p):
                self._hook(i, p, True)
            else:
                self.param[i] = put_back(p, self._off.pop(i, None), self._post_fns[i])

    def _release(self, i: int) -> None:
        """Drop parameter ``i``'s emptied pre-hook dict; inside a backward pass, later (the
        engine may be walking that very list)."""
        if task_id() >= 0:
            self._unreleased.add(i)
            return
        for j in (i, *self._unreleased):
            if j not in self._pre and j not in self.lit:
                release_pre_hooks(self._refs[j]() if j in self._refs else None)
        self._unreleased.clear()

    def remove_all(self) -> None:
        """Every arrival hook off, and the light ones' dicts dropped (the watcher closes)."""
        for h in self.param.values():
            h.remove()
        for i in {*self.lit, *self._unreleased}:
            if i not in self._pre:  # the HookSet drops those after removing its own
                release_pre_hooks(self._refs[i]() if i in self._refs else None)
        self.deferred.clear()
        for held in (self.param, self._off, self._post_fns, self._light_fns):
            held.clear()
        self.unhooked.clear()
        self.lit.clear()
        self._unreleased.clear()
