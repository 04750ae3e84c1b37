"""Whether a model runs under ``torch.compile``: then gradwatch keeps its hooks as they are.

Adding or removing a module hook changes what dynamo guards on (``len(_forward_hooks)``):
trimming the forward hooks after ``trim_hooks_after`` steps, a saving in eager mode, would
cost a compiled model a recompile. Under compile the hooks are cheap (see
:func:`gradwatch.capture.grads.evidence.make_forward_hook`), so they simply stay.

Example:
    >>> import torch
    >>> is_compiled(torch.nn.Linear(2, 2))
    False
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_compiled"]


def is_compiled(model: nn.Module) -> bool:
    """``model`` is a ``torch.compile`` wrapper, or it or a submodule was ``.compile()``-d."""
    if hasattr(model, "_orig_mod"):
        return True
    inner = getattr(model, "module", None)  # DDP/DataParallel around a compiled model
    if isinstance(inner, nn.Module) and inner is not model and hasattr(inner, "_orig_mod"):
        return True
    # A compiled module deeper in (Lightning Fabric's wrapper around ``torch.compile(m)``).
    return any(
        hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
