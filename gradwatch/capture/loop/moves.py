"""Device and dtype moves of a module: what a call asks for, and whether a module still holds it.

``nn.Module.half/float/double/bfloat16`` ask for a floating dtype, ``cuda/cpu`` for a device,
``to(...)`` for either or both (parsed as torch parses it; ``to(memory_format=...)`` alone
asks for neither). All of them end in ``_apply``, which recurses into the children and also
serves ``share_memory``, ``type`` and the like with opaque functions: the public methods are
where the intent can be read, so they are the ones wrapped
(:mod:`gradwatch.capture.loop.state_calls`). A module holds a dtype when every floating
parameter and buffer has it, a device when every parameter and buffer is on it (a device
without an index, ``cuda``, matches any index).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["METHODS", "holds", "render", "state_of", "wants"]

_DTYPES = {
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "bfloat16": torch.bfloat16,
}
METHODS = (*_DTYPES, "cuda", "cpu", "to")


def wants(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{"dtype": torch.dtype, "device": torch.device}``, the parts ``module.<method>(*args,
    **kwargs)`` asked for (a non-floating dtype is not asked of floating tensors: left out)."""
    if method in _DTYPES:
        return {"dtype": _DTYPES[method]}
    if method == "cpu":
        return {"device": torch.device("cpu")}
    if method == "cuda":
        dev = args[0] if args else kwargs.get("device")
        if dev is None:
            return {"device": torch.device("cuda")}
        return {"device": torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)}
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    out: dict[str, Any] = {}
    if dtype is not None and dtype.is_floating_point:
        out["dtype"] = dtype
    if device is not None:
        out["device"] = torch.device(device)
    return out


def render(method: str, asked: dict[str, Any]) -> str:
    """The call as a person reads it: ``float()``, ``to(torch.bfloat16)``, ``cuda()``."""
    if method != "to":
        return f"{method}()"
    return "to(" + ", ".join(str(v) for v in asked.values()) + ")"


def _tensors(module: nn.Module, floating: bool) -> list[torch.Tensor]:
    out = [*module.parameters(), *module.buffers()]
    return [t for t in out if t.is_floating_point()] if floating else out


def _on(want: torch.device, have: torch.device) -> bool:
    return want.type == have.type and (want.index is None or want.index == have.index)


def holds(module: nn.Module, kind: str, want: Any) -> bool:
    """Whether ``module`` (its parameters and buffers, descendants included) is in ``want``."""
    if kind == "dtype":
        return all(t.dtype == want for t in _tensors(module, True))
    return all(_on(want, t.device) for t in _tensors(module, False))


def state_of(module: nn.Module, kind: str) -> list[str]:
    """The dtypes (or devices) ``module``'s tensors are in, as text, in the order met."""
    seen: dict[str, None] = {}
    get: Callable[[torch.Tensor], Any] = (
        (lambda t: t.dtype) if kind == "dtype" else (lambda t: t.device)
    )
    for t in _tensors(module, kind == "dtype"):
        seen.setdefault(str(get(t)), None)
    return list(seen)
