"""Visible stop-gradients, held constant in finite differences as autograd holds them.

Autograd differentiates the function in which every ``.detach()`` output, and every output
of an op run by the user's code under ``torch.no_grad()`` from tensors that require grad, is
a constant (SimSiam/BYOL's stop-grad branch, VQ-VAE's ``z + (q - z).detach()``, a GAN's
``D(G(z).detach())``). :class:`StopGradients` records those outputs during the evaluation
that autograd differentiates, and hands the recorded values back, in call order, during the
finite-difference evaluations: the numbers then differentiate the same function, and a
difference left is a wrong derivative.

A ``.data`` edit is not a visible stop-gradient: it is what the probe exists to find.
Straight-through ``autograd.Function`` classes declared by ``straight_through = True`` and
fake-quantisation nodes cannot be replayed; the layers upstream of them are explained by
:func:`straight_through_params`. Other custom Functions are measured, never judged by their
class name (:mod:`gradwatch.probes._surgery`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from gradwatch.probes._masks import EMBEDDINGS, EmbeddingMasks

__all__ = [
    "ReplayMismatch",
    "StopGradients",
    "custom_functions",
    "straight_through_params",
    "walk",
]

_DETACH = {"detach", "detach_"}
# torch's fake-quantisation nodes: ``FakeQuantize*Backward0`` (the per-tensor/per-channel,
# cachemask and learnable ops) and ``FusedMovingAvgObsFqHelperBackward0``, the fused observer
# and fake-quant op of the default QAT qconfigs (``get_default_qat_qconfig``).
_FAKE_QUANT_NODE = re.compile(r"FakeQuantize|ObsFq")


class ReplayMismatch(Exception):
    """A finite-difference evaluation ran other stop-gradient ops than the recorded one."""


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", ""))


def _needs_grad(args: Any, kwargs: Any) -> bool:
    found = [False]

    def look(x: Any) -> Any:
        if isinstance(x, Tensor) and x.requires_grad:
            found[0] = True
        return x

    tree_map(look, (args, kwargs))
    return found[0]


def _clone(x: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, x)


class StopGradients(TorchFunctionMode):
    """Record (``replay=False``) or hand back (``replay=True``) stop-gradient outputs.

    Also notes the order in which parameters are first used (``first_use``: ids), which is
    the forward order of the layers.
    """

    def __init__(self, params: Optional[dict[int, int]] = None) -> None:
        super().__init__()
        self.saved: list[Any] = []
        self.replay = False
        self._next = 0
        self._user_off = False  # the user's code disabled grad (not a Function's forward)
        self._params = params or {}
        self.first_use: list[int] = []
        self.autocast = False  # an op of the recorded forward ran under autocast
        self._used: set[int] = set()
        self.masks = EmbeddingMasks(self._params)  # torch's documented embedding masks

    def start(self, *, replay: bool) -> StopGradients:
        self.replay = replay
        self._next = 0
        self._user_off = False
        if not replay:
            self.saved = []
        return self

    def _note_params(self, args: Any) -> None:
        if not self._params:
            return
        for x in args:
            if isinstance(x, Tensor) and id(x) in self._params and id(x) not in self._used:
                self._used.add(id(x))
                self.first_use.append(self._params[id(x)])

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "_set_grad_enabled" and args:
            self._user_off = not bool(args[0])
            return func(*args, **kwargs)
        if not self.replay:
            self._note_params(args)
            if name in EMBEDDINGS:
                self.masks.note(func, args, kwargs)
            if not self.autocast and _autocast_on():
                self.autocast = True
        stop = name in _DETACH or (
            self._user_off and not torch.is_grad_enabled() and not name.endswith("_")
        )
        if not stop or not _needs_grad(args, kwargs):
            return func(*args, **kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            self.saved.append(_clone(out))
            return out
        if self._next >= len(self.saved):
            raise ReplayMismatch(f"an extra stop-gradient op ({name}) ran")
        value = self.saved[self._next]
        self._next += 1
        return _clone(value)


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def walk(loss: Tensor) -> list[Any]:
    """Every node of the loss's autograd graph, each once."""
    seen: set[int] = set()
    nodes: list[Any] = []
    stack: list[Any] = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return nodes


def _upstream_params(node: Any) -> set[int]:
    out: set[int] = set()
    seen: set[int] = set()
    stack = [n for n, _ in node.next_functions]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        var = getattr(n, "variable", None)
        if isinstance(var, Tensor):
            out.add(id(var))
        stack.extend(m for m, _ in n.next_functions)
    return out


def _is_straight_through(node: Any) -> bool:
    """Declared by the class (``straight_through = True``) or torch's fake quantisation; a
    Function that is not declared is measured (:mod:`gradwatch.probes._surgery`)."""
    cls = getattr(node, "_forward_cls", None)
    if cls is not None:
        return bool(getattr(cls, "straight_through", False))
    return bool(_FAKE_QUANT_NODE.search(type(node).__name__))


def straight_through_params(loss: Tensor) -> tuple[set[int], list[str]]:
    """Ids of the parameters upstream of a declared straight-through node, and its names."""
    ids: set[int] = set()
    names: list[str] = []
    for node in walk(loss):
        if _is_straight_through(node):
            ids |= _upstream_params(node)
            cls = getattr(node, "_forward_cls", None)
            names.append(cls.__name__ if cls is not None else type(node).__name__)
    return ids, sorted(set(names))


def custom_functions(loss: Tensor) -> list[str]:
    """The custom ``autograd.Function`` classes in the loss's graph (for the hint)."""
    found = {node._forward_cls.__name__ for node in walk(loss) if hasattr(node, "_forward_cls")}
    return sorted(found)
