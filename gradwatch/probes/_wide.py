"""Casts down kept float64 on the ``gradient_mismatch`` probe's float64 copy."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["KeepWide"]

_CASTS = frozenset(
    {Tensor.to, Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.type, Tensor.type_as}
)


_NARROW = frozenset({torch.float32, torch.float16, torch.bfloat16})


def _any_wide(args: Any) -> bool:
    items = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
    return any(isinstance(a, Tensor) and a.dtype == torch.float64 for a in items)


class KeepWide(TorchFunctionMode):
    """A float64 tensor cast to a narrower float stays float64 (moved as asked), and so does
    an operation on float64 tensors asked for a narrower ``dtype=``.

    Models written for half precision upcast on purpose (``hidden.to(torch.float32)`` in an
    RMSNorm, ``logits.float()`` before a loss); on a float64 copy those casts would round the
    function the finite differences see to float32, and a step sized for float64 would then
    measure rounding, not the derivative. Both sides keep the float64 function instead.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("dtype") in _NARROW and _any_wide(args):  # softmax(x, dtype=float32)
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        if func in _CASTS and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            src = args[0]
            if src.dtype == torch.float64 and out.is_floating_point() and out.dtype != src.dtype:
                return src.to(out.device)
        return out
