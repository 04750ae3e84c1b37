"""Installing, trimming and removing every hook gradwatch adds (and nothing else).

The hooks themselves only record evidence (:mod:`gradwatch.capture.grads.evidence`); this module
owns their handles so that leaving a watcher removes each one, also on error.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.arrival import ArrivalHooks
from gradwatch.capture.grads.evidence import Tracker, make_forward_hook, make_param_hooks
from gradwatch.capture.grads.stamps import ForwardStamp, caller_recorder
from gradwatch.capture.grads.tensor_hooks import release_pre_hooks
from gradwatch.capture.loop.copies import cover_class, uncover_class
from gradwatch.model.engines import clean_name
from gradwatch.model.index import ParamIndex

__all__ = ["COMPILED_WRAPPER", "ForwardStamp", "HookSet", "release_pre_hooks"]

COMPILED_WRAPPER = "<torch.compile wrapper>"  # never a module name (named_modules has no "<")

OnError = Callable[[str, BaseException], None]


class HookSet:
    """Every handle of one watcher: parameter, forward and optimizer hooks.

    Per parameter: an arrival hook (until the step can read its arrival itself,
    ``capture/grads/step_reading.py``) and a pre-accumulation value-check hook (every parameter until
    :meth:`trim`, afterwards only where the tracker asks for it). The arrival hook is a
    post-accumulate hook, or, where ``arrival.light`` and only while the step may come to read
    the parameter (the first steps, a read parameter hooked in turn), a tensor pre-hook that
    defers its work (``capture/grads/deferred.py``): torch can drop that one for good.
    Per layer (a module that owns parameters): a forward hook that stamps its grad mode,
    trimmed to the layers with a ghost finding after ``trim_hooks_after`` steps.
    """

    def __init__(self, tracker: Tracker, on_arrival: Callable[[], None], on_error: OnError):
        self.tracker = tracker
        self._on_arrival = on_arrival
        self._on_error = on_error
        self.other: list[RemovableHandle] = []  # optimizer step hooks
        self.pre: dict[int, RemovableHandle] = {}
        self._pre_fns: dict[int, Any] = {}
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self.arrival = ArrivalHooks(on_error, self.pre, self._refs)
        self.param = self.arrival.param  # arrival hooks on
        # Parameters whose arrival hook is off: the step reads their arrival (step_reading.py).
        self.unhooked = self.arrival.unhooked
        self.forward: dict[str, RemovableHandle] = {}
        self._modules: dict[str, weakref.ref[nn.Module]] = {}
        self._hooked_modules: set[int] = set()
        self.hooked_at: dict[int, int] = {}  # parameter -> event number it was hooked at
        self.last_hooked = 0
        self.trimmed = False
        # A compiled model: never trimmed, forward hooks stamp nothing (compiled.py).
        self.keep_all = False
        self.wanted: set[str] = set()  # layers whose forward hook should come back
        self.removers: list[Callable[[], None]] = []  # other parts' hooks (forward scout, ...)
        self._classes: dict[type, bool] = {}  # module classes whose copies leave hooks out
        # One-shot hooks on flagged modules that own no parameter (a ghost group's cut): the
        # line that calls them (``tracker.want_call``); ``None``: not found in the model.
        self._callers: dict[str, Optional[RemovableHandle]] = {}
        self._root: Optional[weakref.ref[nn.Module]] = None

    def add(self, handle: RemovableHandle) -> None:
        """Keep ``handle`` (e.g. an optimizer step hook) for removal."""
        self.other.append(handle)

    def note_arrival(self) -> None:
        """A gradient arrived that no hook of gradwatch's saw (``capture/grads/in_backward.py``)."""
        self._on_arrival()

    def hook_param(self, i: int, p: torch.Tensor) -> None:
        """The evidence hooks of parameter ``i`` (once; one the step reads stays unhooked)."""
        if i in self.param or i in self.unhooked:
            return
        ref = weakref.ref(p)
        pre, post = make_param_hooks(self.tracker, i, ref, self._on_arrival, self._on_error)
        # Tensor hooks are never saved with a pickled parameter: say so, without a warning.
        torch.utils.hooks.unserializable_hook(pre)
        self._pre_fns[i] = pre
        self._refs[i] = ref
        if not self.trimmed:  # every hook on until trim_hooks_after
            self.pre[i] = p.register_hook(pre)
            self.tracker.has_pre[i] = True
        self.arrival.hook(i, p, post)
        self.hooked_at[i] = self.last_hooked = self.tracker.now()

    def unhook_post(self, i: int) -> None:
        """Parameter ``i``'s arrival hook off: the step reads its arrival instead."""
        self.arrival.unhook(i)

    def rehook_post(self, i: int, light: bool = False) -> None:
        """Parameter ``i``'s arrival hook back on (see :meth:`ArrivalHooks.rehook`)."""
        self.arrival.rehook(i, light)

    def restore_pre_hooks(self, index: ParamIndex) -> None:
        """Value checks back on for the parameters whose resets the version cannot tell."""
        tracker = self.tracker
        for i in tracker.want_pre:
            p = index.params[i].ref()
            if p is None or i in self.pre or i not in self._pre_fns:
                continue
            self.rehook_post(i)  # a value check pairs with its post hook
            self.pre[i] = p.register_hook(self._pre_fns[i])
            tracker.has_pre[i] = True
        tracker.want_pre.clear()

    def hook_modules(self, model: nn.Module) -> None:
        """A forward hook on each layer not seen before (until trimmed).

        Every module class of the model is covered: its copies carry none of gradwatch's
        hooks (``capture/loop/copies.py``), the scout's and the NaN probe's included.
        """
        self._root = weakref.ref(model)
        for cls in {type(m) for m in model.modules()} - self._classes.keys():
            self._classes[cls] = cover_class(cls)
        for name, mod in model.named_modules():
            if id(mod) in self._hooked_modules or not mod._parameters:
                continue
            name = clean_name(name)  # as the index names layers
            self._hooked_modules.add(id(mod))
            self._modules[name or "(root)"] = weakref.ref(mod)
            if not self.trimmed:
                self.hook_forward(name or "(root)")

    def hook_layer(self, name: str, mod: nn.Module) -> None:
        """A forward hook on ``mod`` as layer ``name`` although it owns no parameter (FSDP1
        flattened them away): a ghost's cause comes from its stamps, as for any layer."""
        if id(mod) in self._hooked_modules:
            return
        self._hooked_modules.add(id(mod))
        self._modules[name] = weakref.ref(mod)
        if not self.trimmed:
            self.hook_forward(name)

    def layers(self) -> list[tuple[str, nn.Module]]:
        """Every layer seen so far (as the index names it) and its module, while alive."""
        live = ((name, ref()) for name, ref in self._modules.items())
        return [(name, mod) for name, mod in live if mod is not None]

    def hook_forward(self, layer: str) -> None:
        """Stamp when ``layer`` runs (and in which grad mode): a ghost's cause comes from it."""
        mod = self._modules.get(layer)
        module = mod() if mod is not None else None
        if module is None or layer in self.forward:
            return
        hook = ForwardStamp(make_forward_hook(self.tracker, layer, self._on_error), module)
        self.forward[layer] = module.register_forward_hook(hook)
        if not self.keep_all:  # compiled: no stamps, so a ghost's cause reads "unknown"
            self.tracker.fwd_since[layer] = self.tracker.now()

    def hook_compiled_wrapper(self, wrapper: nn.Module) -> None:
        """Stamp, outside dynamo, that a ``torch.compile`` wrapper ran (and in which grad mode).

        Its layers' hooks stamp nothing while compiled; the wrapper's own hook runs eagerly,
        so "the model ran" (``not_observed``) still holds. Keyed by a name no layer has.
        """
        hook = make_forward_hook(self.tracker, COMPILED_WRAPPER, self._on_error)
        self.other.append(wrapper.register_forward_hook(hook))

    def restore_wanted(self) -> None:
        """Forward hooks back on the layers a step asked for (a ghost seen while trimmed)."""
        for layer in self.wanted:
            self.hook_forward(layer)
        self.wanted.clear()
        if self.tracker.want_call and self._root is not None:
            self._hook_callers()

    def _hook_callers(self) -> None:
        """A one-shot forward hook on each flagged module without a layer hook (the
        ``nn.Sequential`` whose output one ``.detach()`` cut off): the line that calls it,
        where the cut usually is."""
        root = self._root() if self._root is not None else None
        tracker = self.tracker
        for name in [n for n in tracker.want_call if n not in self._modules]:
            if name in self._callers or root is None:
                continue
            try:
                mod: Optional[nn.Module] = root.get_submodule(name)
            except AttributeError:  # a wrapper's name, or a module gone
                mod = None
            if mod is None:
                self._callers[name] = None
                continue

            record = caller_recorder(tracker, self._callers, name, self._on_error)
            self._callers[name] = mod.register_forward_hook(ForwardStamp(record, mod))

    def trim(self, keep_layers: set[str]) -> None:
        """After ``trim_hooks_after`` steps keep hooks only where they found something to watch.

        A forward hook on every layer puts every module call on nn.Module's slow path; a
        ghost that appears later gets its hook back and its cause from its next missing step.
        Value-check hooks stay where the version counter could not tell a reset apart.
        """
        tracker = self.tracker
        for layer in [name for name in self.forward if name not in keep_layers]:
            self.forward.pop(layer).remove()
            tracker.fwd_since.pop(layer, None)
        # The first parameter to arrive keeps its own: capture/grads/resets.py checks the others at
        # its arrival, when its gradient is already accumulated.
        keep = tracker.want_pre | {tracker.leader}
        for i in [i for i in self.pre if i not in keep]:
            self.pre.pop(i).remove()
            release_pre_hooks(self._refs[i]() if i in self._refs else None)
            tracker.has_pre[i] = False
        tracker.want_pre.clear()
        # The reset sweep runs at the leader's arrival: a post hook's time, not a deferred one.
        self.arrival.settle(tracker.leader)
        self.trimmed = True

    def remove_all(self) -> None:
        """Remove every handle (idempotent)."""
        for h in [*self.other, *self.forward.values(), *self.pre.values()]:
            h.remove()
        self.arrival.remove_all()
        for i in self.pre:
            release_pre_hooks(self._refs[i]() if i in self._refs else None)
        for c in self._callers.values():
            if c is not None:
                c.remove()
        self._callers.clear()
        self.other.clear()
        self.forward.clear()
        self.pre.clear()
        self._pre_fns.clear()
        self._refs.clear()
        removers, self.removers = self.removers, []
        for remove in removers:
            remove()
        classes, self._classes = self._classes, {}
        for cls, covered in classes.items():
            if covered:
                uncover_class(cls)
