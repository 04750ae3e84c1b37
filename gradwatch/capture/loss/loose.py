"""What ``Tensor.backward`` is called on: the loss, and the loose leaves its graph trains.

While a watcher that needs it is open, ``torch.Tensor.backward`` is wrapped (one wrapper for
every watcher, removed when the last one closes): the wrapper hands the root tensor to each
:class:`BackwardRoots` and calls the original. ``torch.autograd.backward`` called directly
and ``torch.autograd.grad`` are not seen (the latter writes no ``.grad``).

- *The loss* (``nonfinite_param``): one device flag per backward, ``isfinite(root)``, kept as
  a tensor and read with the step's one host transfer. A NaN loss behind finite gradients
  (a non-finite term added through ``.detach()``) is seen nowhere else in a plain loop.
- *Loose leaves* (``unregistered_param``): during the first ``scan_steps`` steps, the graph
  is walked once per backward from its root (``grad_fn.next_functions``, in Python, capped
  at :data:`MAX_NODES`) and every ``AccumulateGrad`` node's ``variable`` that requires grad
  and is not watched (in no watched model nor watched optimizer) is a *sighting*. A leaf is
  *loose* when the very same object (identity, not shape) is seen again in a later step's
  window with its version counter unchanged: it persists, receives gradients from the loss,
  and nothing updates it. So tensors that require grad as *inputs* on purpose (adversarial
  examples ``x.requires_grad_()``, saliency, gradient-penalty interpolates) are new objects
  each step and never loose; a second model trained by an optimizer gradwatch does not
  watch (a GAN's other half) moves its version at every step and is not loose either.
  Nor is a leaf whose values changed (updated by hand through ``.data``, which leaves the
  version alone: a strided sample of it is kept from its first sighting), one an optimizer
  gradwatch does not watch holds (it may step rarely: a temperature's own optimizer every
  few steps), or one handed to the watched model's forward as it is (an input
  differentiated against: a PINN's collocation points).

Nothing syncs: the walk reads graph metadata only, the flags stay tensors.
"""

from __future__ import annotations

import functools
import gc
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.capture.forward.forward_scout import ForwardScout
from gradwatch.capture.loss.leaf_names import LooseLeaf, name_of

__all__ = ["MAX_NODES", "BackwardRoots", "LooseLeaf", "name_of"]

MAX_NODES = 100_000  # graph nodes walked per backward, at most
_MAX_SIGHTED = 256  # unwatched leaves followed at once (fresh inputs are forgotten)
_MAX_FLAGS = 16  # loss flags kept per window (more are folded into one)

_original: Optional[Callable[..., Any]] = None
_listeners: list[weakref.ref[BackwardRoots]] = []


def _backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    for ref in list(_listeners):
        me = ref()
        if me is not None:
            me.root(self)
    assert _original is not None
    return _original(self, *args, **kwargs)


def _add(listener: BackwardRoots) -> None:
    global _original
    # Once in place, the wrapper stays in any chain another library built on top of it (a
    # pass-through while nobody listens): wrapping again would call itself through theirs.
    if _original is None:
        _original = torch.Tensor.backward
        functools.update_wrapper(_backward, _original)
        torch.Tensor.backward = _backward  # type: ignore[method-assign]
    _listeners.append(weakref.ref(listener))


def _drop(listener: BackwardRoots) -> None:
    global _original
    _listeners[:] = [r for r in _listeners if r() is not None and r() is not listener]
    if not _listeners and _original is not None and torch.Tensor.backward is _backward:
        torch.Tensor.backward = _original  # type: ignore[method-assign]
        _original = None


@dataclass
class _Sighting:
    ref: weakref.ref[torch.Tensor]
    version: int
    window: int
    sample: Optional[torch.Tensor] = None  # a strided sample of its values


def _sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 64)][:64].clone()


def _held_by_optimizer(t: torch.Tensor) -> bool:
    """Whether a param group of some optimizer (``{"params": [..., t, ...]}``) holds ``t``."""
    for seq in gc.get_referrers(t):
        if isinstance(seq, list):
            for group in gc.get_referrers(seq):
                if isinstance(group, dict) and group.get("params") is seq:
                    return True
    return False


class BackwardRoots:
    """One watcher's listener on ``Tensor.backward`` (see the module docstring)."""

    def __init__(
        self,
        known: Callable[[torch.Tensor], bool],
        on_error: Callable[[str, BaseException], None],
        *,
        loss: bool,
        scan_steps: int,
        model: Optional[nn.Module] = None,
        fed: Callable[[torch.Tensor], bool] = lambda t: False,
    ) -> None:
        self._known = known
        self._fed = fed
        self._on_error = on_error
        self.loss = loss
        self.scan_steps = scan_steps
        self._model = weakref.ref(model) if model is not None else None
        self.window = 0  # windows closed so far (optimizer steps, all optimizers together)
        self._sighted: dict[int, _Sighting] = {}
        self._done: set[int] = set()  # leaves judged (loose, or updated elsewhere)
        self._loose: list[LooseLeaf] = []
        self._held: list[_Sighting] = []  # held by an optimizer gradwatch does not watch
        self._flags: list[torch.Tensor] = []
        self.host_nonfinite = False  # a float loss an integration handed over was NaN/Inf
        self._finite: Optional[bool] = None  # the step being decided: its losses' flag
        self.walked = 0  # graph nodes walked so far (for benchmarks)
        self.calls = 0  # Tensor.backward calls seen (a loss that reaches no parameter too)
        _add(self)

    @classmethod
    def wanted_by(
        cls, wanted: dict[str, Any], pipe: Any, scout: ForwardScout
    ) -> Optional[BackwardRoots]:
        """A listener where the enabled checks need the loss (``loss_value``) or loose leaves
        (``loose_leaves``: the steps to scan), else ``None``; removed with ``pipe``'s hooks.

        ``pipe`` (the step pipeline, typed loosely: no import circle) says what is known: its
        watched parameters, and those of unregistered modules the ``scout`` names. Under a
        sharding engine (FSDP1's flat parameters, FSDP2's unsharded ones) autograd's leaves
        are the engine's own tensors, never the watched ones: no leaf is judged there.
        """
        loose = int(wanted.get("loose_leaves", 0))
        if not loose and "loss_value" not in wanted:
            return None
        wpipe = weakref.ref(pipe)

        def known(p: torch.Tensor) -> bool:
            pl = wpipe()
            return (
                pl is None
                or pl.sharded is not None
                or pl.structure.index.lookup(p) is not None
                or scout.follows(p)
            )

        me = cls(
            known,
            pipe.faults.callback(),
            loss="loss_value" in wanted,
            scan_steps=loose,
            model=pipe.model,
            fed=scout.fed,
        )
        pipe.hooks.removers.append(me.remove)
        return me

    @property
    def scanning(self) -> bool:
        return self.window < self.scan_steps

    def root(self, t: torch.Tensor) -> None:
        """``t.backward()`` is about to run."""
        self.calls += 1
        try:
            if self.loss and t.is_floating_point():
                self._note_loss(t.detach())
            if self.scanning and t.grad_fn is not None:
                self._walk(t.grad_fn)
        except Exception as exc:  # never the user's backward
            self._on_error("backward root", exc)

    def _note_loss(self, t: torch.Tensor) -> None:
        flag = torch.isfinite(t) if t.dim() == 0 else torch.isfinite(t).all()
        if len(self._flags) >= _MAX_FLAGS:
            self._flags[-1] = self._flags[-1] & flag
        else:
            self._flags.append(flag)

    def note_loss(self, loss: Any) -> None:
        """A loss an integration saw (a tensor, or a float already on the host)."""
        if isinstance(loss, torch.Tensor):
            if loss.is_floating_point():
                self._note_loss(loss.detach())
        elif isinstance(loss, (float, int)) and not math.isfinite(loss):
            self.host_nonfinite = True  # already on the host (HF's logged loss): no transfer

    def loss_flags(self) -> list[torch.Tensor]:
        """The window's loss flags as one float tensor for the step's transfer (or none)."""
        flags, self._flags = self._flags, []
        if not flags:
            return []
        if len(flags) == 1:  # one backward a step (the usual loop): no stack to build
            return [flags[0].reshape(1).float()]
        device = flags[0].device
        both = [f.to(device) for f in flags]
        return [torch.stack(both).all().reshape(1).float()]

    def read(self, value: float) -> None:
        """The step's transfer read the window's loss flag (1.0: every loss finite)."""
        self._finite = value > 0.5

    def verdict(self, skipped: int = 0) -> Optional[bool]:
        """``False``: a loss of the window was NaN/Inf; ``None``: no loss seen, or the
        GradScaler skipped ``skipped`` steps of the window (their gradients were not finite
        either: ``nonfinite_grad``'s and the scaler's, not a loss behind finite gradients)."""
        finite, self._finite = self._finite, None
        if self.host_nonfinite:
            self.host_nonfinite = False
            finite = False
        return None if skipped else finite

    def _walk(self, fn: Any) -> None:
        seen: set[int] = {id(fn)}
        stack = [fn]
        leaves: list[torch.Tensor] = []
        n = 0
        while stack and n < MAX_NODES:
            node = stack.pop()
            n += 1
            var = getattr(node, "variable", None)
            if var is not None:
                leaves.append(var)
                continue
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in seen:
                    seen.add(id(nxt))
                    stack.append(nxt)
        self.walked += n
        for leaf in leaves:
            if leaf.requires_grad and not self._known(leaf):
                self._sight(leaf)

    def _sight(self, leaf: torch.Tensor) -> None:
        key = id(leaf)
        if key in self._done:
            return
        s = self._sighted.get(key)
        if s is None or s.ref() is not leaf:
            if len(self._sighted) >= _MAX_SIGHTED:
                self._forget()
            self._sighted[key] = _Sighting(
                weakref.ref(leaf), leaf._version, self.window, _sample(leaf)
            )
            return
        if s.window == self.window:
            return  # the same step (accumulation, PGD's inner steps): not yet persistent
        self._sighted.pop(key)
        self._done.add(key)
        if leaf._version != s.version:
            return  # something updates it (an optimizer gradwatch does not watch, by hand)
        if s.sample is not None and not torch.equal(s.sample, _sample(leaf)):
            return  # updated through ``.data`` (no version bump): by hand, on purpose
        if self._fed(leaf):
            return  # an input differentiated against (a PINN's collocation points)
        model = self._model() if self._model is not None else None
        if model is not None and any(p is leaf for p in model.parameters()):
            return  # the model's own (a layer replaced in the run, not read yet): no leaf
        if _held_by_optimizer(leaf):
            self._held.append(s)  # its optimizer may step apart: judged when the scan ends
            return
        self._loose.append(name_of(leaf, model))

    def _forget(self) -> None:
        """Drop the sightings whose tensor is gone, then the oldest (fresh inputs)."""
        for key in [k for k, s in self._sighted.items() if s.ref() is None]:
            self._sighted.pop(key)
        while len(self._sighted) >= _MAX_SIGHTED:
            self._sighted.pop(next(iter(self._sighted)))

    def take_loose(self, model_ran: bool = True) -> list[LooseLeaf]:
        """The loose leaves found since the last call (each once). None while the watched
        model never ran: what trains is another instance (``not_observed``, one cause)."""
        out, self._loose = self._loose, []
        return out if model_ran else []

    def window_closed(self) -> None:
        self.window += 1
        if not self.scanning:
            self._sighted.clear()
            held, self._held = self._held, []
            model = self._model() if self._model is not None else None
            for s in held:  # its optimizer never stepped on it over the scan: loose after all
                leaf = s.ref()
                if leaf is not None and leaf._version == s.version:
                    if s.sample is None or torch.equal(s.sample, _sample(leaf)):
                        self._loose.append(replace(name_of(leaf, model), held=True))

    def remove(self) -> None:
        _drop(self)
        self._sighted.clear()
        self._flags.clear()
