"""FSDP1: whether a layer's output reached the loss, where its gradient cannot say.

FSDP1 (``use_orig_params=True`` or flattened) hands a parameter that got no gradient a zero
slice after its reduce-scatter, and no hook on an original parameter fires: a layer that ran
but whose output never reached the loss (an unused head, a ``.detach()``, a router behind an
``argmax``) looks like a layer whose gradient is zero. Its output says it: while watched, a
forward hook on each layer puts a tensor hook on the output tensors of each call in grad
mode, and the first gradient to reach one stamps the layer (an event number of the run's
tracker). :func:`gradwatch.distributed.layout.forward_arrival` then counts a layer's
parameters as arrived when the layer ran with grad *and* a gradient reached its output in
the window: a disconnected layer is a ``ghost_param`` (cause ``disconnected``), a dead ReLU
layer (its output gets zeros, the hook still fires) is not.

A layer whose output holds no tensor that requires grad (a custom output type) is never
judged this way: its forward alone counts, as before. One tensor hook per layer call, under
FSDP1 only; nothing syncs.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.stamps import ForwardStamp

__all__ = ["OutputReach", "reach_of"]

OnError = Callable[[str, BaseException], None]

_REACH: weakref.WeakKeyDictionary[Tracker, OutputReach] = weakref.WeakKeyDictionary()


def reach_of(tracker: Tracker) -> Optional[OutputReach]:
    """The output reach recorded for ``tracker``'s run, if its engine needs one."""
    return _REACH.get(tracker)


def _tensors(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a layer's output that require grad (tuples, lists, dicts: 2 levels)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if depth >= 2:
        return []
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in _tensors(v, depth + 1)]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _tensors(v, depth + 1)]
    return []


class OutputReach:
    """Per layer: the event number of the last gradient that reached one of its outputs."""

    def __init__(self, tracker: Tracker, on_error: OnError) -> None:
        self.tracker = tracker
        self.reached: dict[str, int] = {}
        self.unreadable: set[str] = set()  # layers whose output holds no grad-requiring tensor
        self._on_error = on_error
        self._hooked: set[int] = set()
        self._handles: list[RemovableHandle] = []
        _REACH[tracker] = self

    def cover(self, layers: Iterable[tuple[str, nn.Module]]) -> None:
        """A forward hook on each layer not covered yet."""
        for name, mod in layers:
            if id(mod) in self._hooked:
                continue
            self._hooked.add(id(mod))
            # ForwardStamp: a copy of the layer (EMA, deepcopy) or a pickle carries no hook
            hook = ForwardStamp(self._forward_hook(name), mod)
            self._handles.append(mod.register_forward_hook(hook))

    def _forward_hook(self, layer: str) -> Callable[..., None]:
        wself = weakref.ref(self)

        def reached(grad: torch.Tensor) -> None:
            me = wself()
            if me is not None:
                me.reached[layer] = next(me.tracker.counter)

        def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
            me = wself()
            if me is None or not torch.is_grad_enabled():
                return
            try:
                outs = _tensors(output)
                if not outs:
                    me.unreadable.add(layer)
                for t in outs:
                    t.register_hook(reached)
            except Exception as exc:  # inside the user's forward: never break it
                me._on_error("FSDP1 output reach hook", exc)

        return forward_hook

    def arrived(self, layer: str, start: int) -> bool:
        """Whether a gradient reached ``layer``'s output after event ``start`` (a layer it
        cannot judge counts as reached)."""
        return layer in self.unreadable or self.reached.get(layer, 0) > start

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        _REACH.pop(self.tracker, None)
