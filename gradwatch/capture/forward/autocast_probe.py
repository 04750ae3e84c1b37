"""Which dtype each matmul-type layer produced inside an enabled autocast region.

From the first training forward that enters the model inside an enabled autocast region,
and for ``STEPS`` training steps, a forward hook on every linear and convolution layer
records the dtype of its output (tensor metadata: no kernel, no sync), whether autocast was
enabled in the thread that ran it, and whether that thread was the one that entered the
model. Then the hooks come off; a run without autocast pays one pre-hook on the model.
``autocast_bypassed`` compares each layer with its peers of the same kind.

Told apart:

- *deliberate*: the layer ran in the model's thread with autocast disabled
  (``torch.autocast(enabled=False)`` around it), or its output comes from a custom autograd
  function with a decorated forward (``torch.amp.custom_fwd(cast_inputs=torch.float32)``);
- *escaped*: autocast was enabled around it and it still produced float32 (a hand-written
  matmul that autocast does not cover, a kernel without an autocast rule), or it ran in
  another thread while the model's forward was inside autocast (autocast is thread-local:
  ``nn.DataParallel`` replicas, a thread pool for parallel branches).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.forward.nan_probe import _not_eager, _Owned
from gradwatch.model.engines import clean_name
from gradwatch.model.named import entry_points

__all__ = ["STEPS", "AutocastProbe", "LayerDtype"]

STEPS = 3  # training steps the hooks stay on
_KINDS: tuple[tuple[str, type], ...] = (
    ("linear", nn.Linear),
    ("conv", nn.modules.conv._ConvNd),
)


@dataclass(frozen=True)
class LayerDtype:
    """One matmul-type layer's output inside an autocast region."""

    kind: str  # linear / conv
    dtype: str  # what it produced: "float32", "bfloat16", ...
    autocast_dtype: str  # what the region asked for
    escaped: str  # "" (autocast applied to it), "thread" (another thread), "op" (not covered)


def _kind(mod: nn.Module) -> Optional[str]:
    for kind, cls in _KINDS:
        if isinstance(mod, cls):
            return kind
    return None


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _decorated_function(t: torch.Tensor) -> bool:
    """Made by a custom autograd Function whose forward is wrapped (``custom_fwd``)."""
    cls = getattr(t.grad_fn, "_forward_cls", None)
    return cls is not None and hasattr(cls.forward, "__wrapped__")


class AutocastProbe:
    """Output dtypes of linear/conv layers during the first training steps."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []  # the model's pre-hook
        self._layers: list[RemovableHandle] = []  # the layers' hooks, while on
        self._device = "cpu"
        self._thread: Optional[int] = None  # the thread that entered the model
        self._region: Optional[torch.dtype] = None  # the autocast dtype at the root's entry
        self.seen: dict[str, LayerDtype] = {}
        self.steps = 0

    def install(self, model: nn.Module) -> None:
        """A pre-hook on the model; the layer hooks follow at its first forward in autocast."""
        if self._handles:
            return
        first = next(model.parameters(), None)
        self._device = first.device.type if first is not None else "cpu"
        wself = weakref.ref(self)
        mref = weakref.ref(model)

        def enter(m: nn.Module, args: Any) -> None:
            me = wself()
            if me is None or _not_eager() or not torch.is_grad_enabled():
                return
            dev = me._device
            me._thread = threading.get_ident()
            on = torch.is_autocast_enabled(dev)
            me._region = torch.get_autocast_dtype(dev) if on else None
            root = mref()
            # accelerate (HF Trainer, Lightning Fabric) enters autocast inside a forward it
            # patched onto the instance: the region starts after this hook.
            if root is not None and not me._layers and me.steps < STEPS:
                if on or "forward" in vars(m):
                    me._hook_layers(root)

        for entry in entry_points(model):  # the named models of watch({"G": ..., "D": ...})
            self._handles.append(entry.register_forward_pre_hook(_Owned(enter, entry)))

    def _hook_layers(self, model: nn.Module) -> None:
        """Forward hooks on the linear/conv layers (installed only once autocast is seen)."""
        wself = weakref.ref(self)
        for raw, mod in model.named_modules():
            name = clean_name(raw)
            kind = _kind(mod)
            if kind is None:
                continue

            def record(
                m: nn.Module, args: Any, out: Any, name: str = name, kind: str = kind
            ) -> None:
                me = wself()
                if me is not None and not _not_eager():
                    me._record(name, kind, out)

            self._layers.append(mod.register_forward_hook(_Owned(record, mod)))

    def _record(self, name: str, kind: str, out: Any) -> None:
        t = _first_tensor(out)
        if t is None or not t.is_floating_point() or not torch.is_grad_enabled():
            return
        dev = self._device
        on = torch.is_autocast_enabled(dev)
        same_thread = threading.get_ident() == self._thread
        if same_thread and on:
            region: Optional[torch.dtype] = torch.get_autocast_dtype(dev)
        elif not same_thread and self._region is not None:
            region = self._region
        else:
            return  # no autocast region, or disabled around this layer on purpose
        if region is None or _decorated_function(t):
            return
        escaped = "" if t.dtype == region else ("thread" if not same_thread else "op")
        self.seen[name] = LayerDtype(
            kind, str(t.dtype).removeprefix("torch."), str(region).removeprefix("torch."), escaped
        )

    def after_step(self) -> None:
        """A training step ended: the layers' hooks come off after ``STEPS`` steps with them."""
        if not self._layers:
            return
        self.steps += 1
        if self.steps >= STEPS:
            self.remove()

    def take(self) -> dict[str, LayerDtype]:
        seen, self.seen = self.seen, {}
        return seen

    def remove(self) -> None:
        for h in [*self._handles, *self._layers]:
            h.remove()
        self._layers.clear()
        self._handles.clear()
