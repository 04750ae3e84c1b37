"""Every torch loss call of a scan step, with cheap reductions of the values it was given.

A ``torch.overrides.TorchFunctionMode`` is pushed when the watched model's forward starts in
grad mode on a scan step, and popped when ``Tensor.backward`` is called (or the window
closes). Every ``torch.nn.functional`` loss dispatches to an active mode before it runs, so
the mode sees ``F.binary_cross_entropy`` whatever the user imported (``from
torch.nn.functional import nll_loss``, ``nn.BCELoss``, a loss computed inside the model's
forward as Hugging Face models do). For each loss call the rule of
:mod:`gradwatch.capture.loss.domains` names the arguments it constrains; their 0-dim
reductions stay on the device for the step's one host transfer. The user's line is read
from the stack once per loss call, during scan steps only.

The mode is pushed only over an empty mode stack (or torch's default-device context), so
a mode of the user's is never popped by gradwatch's, nor gradwatch's by the user's. One left
below a mode the user pushed later turns inert (it passes every call through) and is popped
when it is on top again. Off the scan steps nothing is pushed: the cost is the forward
pre-hook's flag test.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

from gradwatch.capture.forward.nan_probe import _not_eager, _Owned
from gradwatch.capture.loss.domains import LOSS_RULES, Demand, demands, reduce
from gradwatch.capture.loss.graph_walk import PASS_THROUGH
from gradwatch.capture.loss.loose import BackwardRoots
from gradwatch.model.locations import call_site

__all__ = ["LossCall", "LossDomain"]

_MAX_CALLS = 32  # loss calls read per window, at most
_NORMALISERS = {"SoftmaxBackward0": "softmax", "SigmoidBackward0": "sigmoid"}


@dataclass
class LossCall:
    """One loss call of a scan step and what its arguments showed."""

    loss: str  # the functional's name (``binary_cross_entropy``)
    module: Optional[str]  # the ``nn`` loss class that called it (``BCELoss``), if any
    site: Optional[str]  # the user's line
    demands: list[Demand]
    settings: dict[str, Any] = field(default_factory=dict)  # reduction, log_target, ...
    normalised: Optional[str] = None  # the input is a softmax's/sigmoid's output
    values: list[list[float]] = field(default_factory=list)  # each demand's reductions
    leaves: list[weakref.ref[torch.Tensor]] = field(default_factory=list, repr=False)
    """The leaves upstream of the loss's input, nearest first (named by the source)."""
    params: list[str] = field(default_factory=list)  # their names, once named
    producer: Optional[str] = None  # the module of the nearest one
    backward: int = 0  # the window's backward pass it preceded (0: the first)
    count: float = math.nan  # the elements its reduction divides by (weights summed)
    value: float = math.nan  # its output, when a scalar


class _DomainMode(TorchFunctionMode):
    """Passes every call through; notes the loss calls while ``live``."""

    def __init__(self, owner: LossDomain) -> None:
        super().__init__()
        self.owner = weakref.ref(owner)
        self.live = True

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        me = self.owner() if self.live and func in LOSS_RULES else None
        counted = me.seen(func, args, kwargs) if me is not None else None
        out = func(*args, **(kwargs or {}))
        if me is not None and counted is not None:
            me.output(counted, out)
        return out


def _normalised(x: Any) -> Optional[str]:
    fn = getattr(x, "grad_fn", None)
    for _ in range(16):
        if fn is None:
            return None
        kind = type(fn).__name__
        if kind in _NORMALISERS:
            return _NORMALISERS[kind]
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if kind not in PASS_THROUGH or len(nxt) != 1:
            return None
        fn = nxt[0]
    return None


_PREDICTION = ("input", "log_probs", "input1")  # the argument the model's output is
_MAX_WALK = 4096  # graph nodes walked per loss call for its upstream leaves, at most


def _upstream(b: dict[str, Any]) -> list[weakref.ref[torch.Tensor]]:
    """The leaf tensors the loss's prediction depends on, breadth first (nearest first)."""
    x = next((b[k] for k in _PREDICTION if isinstance(b.get(k), torch.Tensor)), None)
    fn = getattr(x, "grad_fn", None)
    if fn is None:
        return []
    out: list[weakref.ref[torch.Tensor]] = []
    seen, queue, n = {id(fn)}, deque([fn]), 0
    while queue and n < _MAX_WALK:
        node = queue.popleft()
        n += 1
        var = getattr(node, "variable", None)
        if var is not None:
            out.append(weakref.ref(var))
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                queue.append(nxt)
    return out


def _loss_module() -> Optional[str]:
    """The ``nn`` loss module whose ``forward`` is on the stack (a few frames up), if any."""
    frame: Any = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        me = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if isinstance(me, nn.modules.loss._Loss):
            return type(me).__name__
        frame = frame.f_back
    return None


def _stack_is_ours_to_use() -> bool:
    n = torch._C._len_torch_function_stack()
    return all(isinstance(torch._C._get_function_stack_at(i), DeviceContext) for i in range(n))


class LossDomain(BackwardRoots):
    """One watcher's reader of its loss calls on scan steps (see the module docstring)."""

    def __init__(
        self, model: nn.Module, on_error: Callable[[str, BaseException], None], scan_steps: int
    ) -> None:
        super().__init__(lambda p: True, on_error, loss=False, scan_steps=scan_steps)
        self.loss_calls: list[LossCall] = []
        self._stats: list[torch.Tensor] = []
        self._pending: list[LossCall] = []
        self._mode: Optional[_DomainMode] = None
        self._thread = 0
        self._hooks: list[Any] = []
        self.seen_calls = 0  # loss calls read so far (for benchmarks)
        self._split: list[torch.Tensor] = []  # per kept call: its count and value
        self._roots: list[torch.Tensor] = []  # per backward after a kept call: its root
        self._backwards = 0
        self._n_roots = 0
        self.roots: list[float] = []  # the last window's, read back by :meth:`take`
        wself = weakref.ref(self)

        def pre(module: nn.Module, args: Any) -> None:
            me = wself()
            if me is not None and me.scanning:
                me.arm()

        for mod in [model, *model.children()]:
            self._hooks.append(mod.register_forward_pre_hook(_Owned(pre, mod)))

    # -- the mode --------------------------------------------------------------------------

    def arm(self) -> None:
        """Push the mode (a training forward on a scan step begins)."""
        try:
            if self._mode is not None:
                self._settle()
            if self._mode is not None or not torch.is_grad_enabled() or _not_eager():
                return
            if not _stack_is_ours_to_use():
                return
            self._mode = _DomainMode(self)
            self._thread = threading.get_ident()
            torch._C._push_on_torch_function_stack(self._mode)
        except Exception as exc:  # never the user's forward
            self._on_error("loss domain", exc)

    def disarm(self) -> None:
        """Pop the mode if it is on top of this thread's stack; else make it inert."""
        mode = self._mode
        if mode is None:
            return
        mode.live = False
        self._settle()

    def _settle(self) -> None:
        mode = self._mode
        if mode is None or mode.live or threading.get_ident() != self._thread:
            return
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is mode:
            torch._C._pop_torch_function_stack()
            self._mode = None
        elif not any(torch._C._get_function_stack_at(i) is mode for i in range(n)):
            self._mode = None  # popped by someone else's exit: gone either way

    def seen(self, func: Any, args: Any, kwargs: Any) -> Optional[torch.Tensor]:
        """A loss call while the mode is live: its demands and their reductions; the count
        its reduction divides by, when it was kept."""
        try:
            if len(self.loss_calls) >= _MAX_CALLS or not torch.is_grad_enabled():
                return None
            b, wants = demands(func, args, kwargs)
            kept: list[Demand] = []
            for d in wants:
                x = b.get(d.role)
                if isinstance(x, torch.Tensor) and x.numel() > 0:
                    vals = reduce(d, x)
                    kept.append(d)
                    self._stats.extend(vals)
            if not kept:
                return None
            settings = {
                k: b[k]
                for k in ("reduction", "log_target", "log_input", "ignore_index", "label_smoothing")
                if isinstance(b.get(k), (str, bool, int, float))
            }
            self.seen_calls += 1
            self.loss_calls.append(
                LossCall(
                    func.__name__,
                    _loss_module(),
                    call_site(),
                    kept,
                    settings,
                    _normalised(b.get("input")),
                    leaves=_upstream(b),
                    backward=self._backwards,
                )
            )
            return _count(b)
        except Exception as exc:  # never the user's loss
            self._on_error("loss domain", exc)
            return None

    def output(self, count: torch.Tensor, out: Any) -> None:
        """The recorded call's result: its count and scalar value join the step's transfer."""
        try:
            ok = isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point()
            value = out.detach().reshape(()).float() if ok else torch.tensor(math.nan)
            self._split.extend([count.float().reshape(()), value])
        except Exception as exc:  # never the user's loss
            self._split.extend([torch.tensor(math.nan)] * 2)
            self._on_error("loss domain", exc)

    # -- the step --------------------------------------------------------------------------

    def root(self, t: torch.Tensor) -> None:
        """``t.backward()`` is about to run: the loss was computed; its value is kept."""
        self.disarm()
        if self.loss_calls and len(self._roots) < _MAX_CALLS:
            try:
                scalar = t.numel() == 1 and t.is_floating_point()
                self._roots.append(
                    t.detach().reshape(()).float() if scalar else torch.tensor(math.nan)
                )
                self._backwards += 1
            except Exception as exc:  # never the user's backward
                self._on_error("loss domain", exc)

    def values(self) -> list[torch.Tensor]:
        """The window's reductions as one float tensor for the step's transfer (or none)."""
        self.disarm()
        stats, self._stats = self._stats, []
        self._pending, self.loss_calls = self.loss_calls, []
        split, self._split, roots, self._roots = self._split, [], self._roots, []
        self._backwards = 0
        if len(split) != 2 * len(self._pending):  # a call whose output was never seen
            split = [torch.tensor(math.nan)] * (2 * len(self._pending))
        self._n_roots = len(roots)
        stats = [*stats, *split, *roots]
        if not stats:
            return []
        device = stats[0].device
        return [torch.stack([s.to(device) for s in stats])]

    def take(self, values: list[float]) -> list[LossCall]:
        """The calls handed over by :meth:`values`, each with its reductions read back."""
        out, self._pending = self._pending, []
        at = 0
        for call in out:
            for d in call.demands:
                n = len(reduce_names(d))
                call.values.append(values[at : at + n])
                at += n
        for call in out:
            if at + 2 <= len(values):
                call.count, call.value = values[at], values[at + 1]
            at += 2
        self.roots = values[at : at + self._n_roots]
        at += self._n_roots
        return out if at == len(values) else []

    def window_closed(self) -> None:
        super().window_closed()
        self.disarm()
        if not self.scanning:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()

    def remove(self) -> None:
        self.disarm()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.loss_calls, self._stats, self._pending = [], [], []
        self._split, self._roots = [], []
        super().remove()


def _count(b: dict[str, Any]) -> torch.Tensor:
    """What a ``mean`` reduction of this call divides by: the targets not ``ignore_index``
    (their class weights summed when weighted), else the target's (or input's) elements;
    ``batchmean``'s and ``ctc_loss``'s: the batch rows."""
    x, target = b.get("input"), b.get("target")
    if b.get("reduction") == "batchmean" and isinstance(x, torch.Tensor) and x.dim() > 0:
        return torch.tensor(float(x.shape[0]))
    lp = b.get("log_probs")  # ctc_loss: a mean over the batch of per-target-length losses
    if isinstance(lp, torch.Tensor):
        return torch.tensor(float(lp.shape[1] if lp.dim() == 3 else 1))
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        t = target.detach()
        ignore = b.get("ignore_index")
        keep = t != ignore if isinstance(ignore, int) else torch.ones_like(t, dtype=torch.bool)
        w = b.get("weight")
        if isinstance(w, torch.Tensor) and w.dim() == 1:
            return w.detach()[t.clamp(0, w.numel() - 1)].mul(keep).sum().float()
        return keep.sum().float()
    ref = target if isinstance(target, torch.Tensor) else x
    return torch.tensor(float(ref.numel() if isinstance(ref, torch.Tensor) else math.nan))


def reduce_names(d: Demand) -> tuple[str, ...]:
    """The names of :func:`~gradwatch.capture.loss.domains.reduce`'s values for ``d``."""
    return {
        "unit": ("min", "max"),
        "logprob": ("max",),
        "nonneg": ("min",),
        "pm1": ("max_dev",),
        "dist": ("max_dev",),
        "index": ("min", "max"),
    }[d.domain]
