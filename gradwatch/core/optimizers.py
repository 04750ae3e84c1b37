"""The real ``torch.optim.Optimizer`` behind the wrappers training frameworks hand out.

accelerate's ``AcceleratedOptimizer`` subclasses ``Optimizer`` without running
``Optimizer.__init__`` (it has no hook registries: registering a step hook on it raises
``AttributeError``), and skips the real step while gradients accumulate. Lightning's
``LightningOptimizer`` imitates its optimizer's class. Both expose the real optimizer as
``.optimizer``; so do most hand-written wrappers. gradwatch hooks the innermost one, whose
``step`` runs exactly once per real update, so accumulation counts right by construction.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> class Wrapper:
    ...     def __init__(self, optimizer):
    ...         self.optimizer = optimizer
    >>> unwrap_optimizer(Wrapper(Wrapper(opt))) is opt
    True
"""

from __future__ import annotations

from typing import Any

import torch

from gradwatch.errors import ConfigError

__all__ = ["unwrap_optimizer"]

# A chain longer than this is a cycle (a wrapper whose ``.optimizer`` leads back to itself).
_MAX_DEPTH = 16


def _initialised(opt: torch.optim.Optimizer) -> bool:
    """Whether ``Optimizer.__init__`` ran: it creates the step-hook registries."""
    return hasattr(opt, "_optimizer_step_pre_hooks")


def unwrap_optimizer(obj: Any, where: str = "optimizer") -> torch.optim.Optimizer:
    """Follow ``.optimizer`` from ``obj`` to the real, hookable ``torch.optim.Optimizer``.

    Args:
        obj: an optimizer, or a wrapper exposing one (possibly wrapped again) as ``.optimizer``.
        where: how the caller names ``obj`` in an error (``optimizer[1]``).

    Returns:
        The innermost optimizer that ran ``Optimizer.__init__``.

    Raises:
        ConfigError: when no such optimizer is found (one line naming ``where`` and the type).

    Example:
        >>> real = unwrap_optimizer(accelerator.prepare(opt))  # doctest: +SKIP
    """
    current = obj
    for _ in range(_MAX_DEPTH):
        inner = getattr(current, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) or _has_inner(inner):
            current = inner  # a wrapper (or a wrapper of a wrapper): the real one is inside
            continue
        if isinstance(current, torch.optim.Optimizer) and _initialised(current):
            return current
        break
    kind = type(obj).__name__
    if isinstance(current, torch.optim.Optimizer):
        raise ConfigError(
            f"{where} is a {kind} that wraps no initialised torch.optim.Optimizer (its "
            "Optimizer.__init__ never ran and it has no .optimizer): pass the real optimizer"
        )
    raise ConfigError(
        f"{where} is a {kind}, not a torch.optim.Optimizer nor a wrapper exposing one as .optimizer"
    )


def _has_inner(obj: Any) -> bool:
    """A non-optimizer wrapper in the middle of a chain (its ``.optimizer`` leads on)."""
    return obj is not None and hasattr(obj, "optimizer") and not isinstance(obj, (str, bytes))
