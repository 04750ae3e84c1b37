"""Naming a loose leaf: what holds it (an attribute of the model, a variable of the training
code), or what holds a tensor computed from it; else its shape.

Read once per loose leaf found (``gradwatch/capture/loss/loose.py``), never on ordinary steps.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from gradwatch.model.locations import _SKIP, call_site

__all__ = ["LooseLeaf", "name_of"]

_FRAMES = 4  # user frames searched for a loose leaf's name


@dataclass
class LooseLeaf:
    """A leaf that persists across steps, gets gradients, and is in no model or optimizer."""

    name: str
    """The best name found: ``criterion.weight``, ``self.log_scale``, ``W``, or its shape."""
    owner: str
    """What to fix: the module or object holding it, or the tensor's own name."""
    shape: tuple[int, ...]
    parameter: bool
    """An ``nn.Parameter`` (a head or module kept outside the model), or a plain tensor."""
    backward_at: Optional[str]
    """The ``backward()`` line whose graph reached it (``train.py:42``)."""
    in_eval: bool = False
    """A parameter of a module in eval mode (a teacher run without ``no_grad``)."""
    copied: bool = False
    """What ``name`` holds is a tensor computed from the leaf (``nn.Parameter(...).to(...)``
    stored as an attribute keeps ``.to()``'s result; the Parameter is registered nowhere)."""
    held: bool = False
    """An optimizer gradwatch does not watch holds it, but never stepped on it in the scan."""


Match = Callable[[Any], bool]


def _made_from(leaf: torch.Tensor) -> Match:
    """Whether a value is a tensor computed from ``leaf`` in a step or two: what
    ``self.scale = nn.Parameter(torch.ones(16)).to(dtype)`` stores (``.to()``'s copy; the
    Parameter itself is held by that copy's graph only)."""

    def match(value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or value.grad_fn is None:
            return False
        stack, n = [(value.grad_fn, 0)], 0
        while stack and n < 16:
            node, depth = stack.pop()
            n += 1
            if getattr(node, "variable", None) is leaf:
                return True
            if depth < 3:
                stack.extend((nxt, depth + 1) for nxt, _ in node.next_functions if nxt is not None)
        return False

    return match


def _in(value: Any, match: Match, path: str, depth: int) -> Optional[tuple[str, str, bool]]:
    """``(name, owner, in a module in eval mode)`` of the leaf that ``match`` recognises
    inside ``value`` (a tensor, module, container, object)."""
    if match(value):
        return path, path, False
    if isinstance(value, torch.Tensor) or depth > 2:
        return None
    if isinstance(value, nn.Module):
        for pname, p in value.named_parameters():
            if match(p):
                # one module kept outside the model is one cause: named by what holds it
                return f"{path}.{pname}", path, not value.training
        for mname, mod in value.named_modules():
            for attr, v in vars(mod).items():
                if isinstance(v, torch.Tensor) and match(v):
                    where = f"{path}.{mname}" if mname else path
                    return f"{where}.{attr}", where, False
        return None
    if isinstance(value, (list, tuple)):
        for k, v in enumerate(value[:64]):
            found = _in(v, match, f"{path}[{k}]", depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, dict):
        for k, v in list(value.items())[:64]:
            found = _in(v, match, f"{path}[{k!r}]", depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, (type, types.ModuleType, types.FunctionType)) or depth >= 2:
        return None
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        for attr, v in list(attrs.items())[:64]:
            if isinstance(v, (torch.Tensor, nn.Module, list, tuple, dict)):
                found = _in(v, match, f"{path}.{attr}", depth + 1)
                if found is not None:
                    return found
    return None


def _user_frames() -> list[Any]:
    out: list[Any] = []
    frame: Any = sys._getframe(1)
    while frame is not None and len(out) < _FRAMES:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP) and not name.startswith("<frozen"):
            out.append(frame)
        frame = frame.f_back
    return out


def _find(match: Match, model: Optional[nn.Module]) -> Optional[tuple[str, str, bool]]:
    """What holds a value ``match`` recognises: the watched model first, then the variables
    of the code that called ``backward()``."""
    found = _in(model, match, "model", 0) if model is not None else None
    if found is not None:  # ``model.temperature``: a plain attribute, not a Parameter
        return found[0].removeprefix("model."), found[1].removeprefix("model."), False
    for frame in _user_frames():
        for scope in (frame.f_locals, frame.f_globals):
            for var, value in list(scope.items()):
                if var.startswith("__") or value is model:
                    continue
                found = _in(value, match, var, 0)
                if found is not None:
                    return found
    return None


def name_of(leaf: torch.Tensor, model: Optional[nn.Module]) -> LooseLeaf:
    """The best name for ``leaf``: an attribute of the watched model (a plain tensor attribute
    of one of its modules), else a variable of the code that called ``backward()`` (its
    locals, ``self``'s attributes, its module's globals), else its shape. Where nothing holds
    the leaf itself, what holds a tensor computed from it names it (``self.scale =
    nn.Parameter(...).to(...)`` keeps ``.to()``'s copy): ``copied`` is set then."""
    found, copied = _find(lambda v: v is leaf, model), False
    if found is None:
        found = _find(_made_from(leaf), model)
        copied = found is not None
    shape = tuple(leaf.shape)
    parameter = isinstance(leaf, nn.Parameter)
    if found is None:
        name = f"<{'Parameter' if parameter else 'tensor'} of shape {list(shape)}>"
        found = (name, name, False)
    owner = found[0] if copied else found[1]  # the attribute holding the copy is the fix
    return LooseLeaf(found[0], owner, shape, parameter, call_site(), found[2], copied)
