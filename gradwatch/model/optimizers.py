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

from typing import Any, Callable, Optional

import torch

from gradwatch.errors import ConfigError

__all__ = ["compensates", "delegates", "group_lr", "unwrap_optimizer"]

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
        inner = delegates(current)  # timm's Lookahead: an Optimizer that never ran __init__
        if inner:
            return inner[0]
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


# Where optimizers that wrap another one keep it: SAM, Lookahead, Opacus's DPOptimizer.
_DELEGATE_ATTRS = ("base_optimizer", "_base_optimizer", "original_optimizer")


def delegates(opt: Any) -> list[torch.optim.Optimizer]:
    """Optimizers that ``opt`` hands its update to, sharing its very ``param_groups`` list.

    SAM (``first_step``/``second_step``) updates through ``base_optimizer.step()`` and never
    runs its own ``step()``; Lookahead's ``step()`` calls its base's, Opacus's ``DPOptimizer``
    (which never runs ``Optimizer.__init__``) its ``original_optimizer``'s. Hooking the delegate as
    well, as the same optimizer, sees the update either way; a delegate's step inside the
    wrapper's own step is the same step (``StepNesting``). timm's Lookahead never runs
    ``Optimizer.__init__`` (it cannot be hooked): :func:`unwrap_optimizer` watches its base.

    Example:
        >>> base = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> class Sam(torch.optim.Optimizer):
        ...     def __init__(self, base):
        ...         super().__init__(base.param_groups, {})
        ...         self.base_optimizer, self.param_groups = base, base.param_groups
        >>> delegates(Sam(base)) == [base]
        True
    """
    found: list[torch.optim.Optimizer] = []
    groups = getattr(opt, "param_groups", None)
    for name in _DELEGATE_ATTRS:
        inner = getattr(opt, name, None)
        if (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not opt
            and _initialised(inner)
            and groups is not None
            and inner.param_groups is groups
            and inner not in found
        ):
            found.append(inner)
    return found


def group_index(opt: Optional[torch.optim.Optimizer], param: torch.Tensor) -> Optional[int]:
    """The index of the param group of ``opt`` that holds ``param`` (``None``: not known)."""
    return GroupMap(opt).index(param)


def group_members(
    opt: Optional[torch.optim.Optimizer],
    g: Optional[int],
    lookup: Callable[[torch.Tensor], Optional[int]],
) -> list[int]:
    """The watched ids (``lookup(tensor)``) of the parameters in param group ``g`` of ``opt``."""
    if opt is None or g is None or not 0 <= g < len(opt.param_groups):
        return []
    ids = (lookup(p) for p in opt.param_groups[g]["params"])
    return [i for i in ids if i is not None]


def group_lr(opt: Optional[torch.optim.Optimizer], param: torch.Tensor) -> Optional[float]:
    """The ``lr`` of the param group of ``opt`` that holds ``param`` (``None``: not known).

    A tensor learning rate (``capturable`` optimizers, some schedulers) is read as a float:
    this runs only when a finding is written, never on the hot path.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> group_lr(torch.optim.SGD([{"params": [w], "lr": 0.0}], lr=0.1), w)
        0.0
    """
    return GroupMap(opt).lr(param)


class GroupMap:
    """Which param group of ``opt`` holds each tensor, from one pass over the groups made on
    first use: a step whose checks ask for every parameter's group asks in O(1) each, not in
    a scan of every group (400 stale layers cost O(parameters**2) a step before).

    Example:
        >>> w, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> m = GroupMap(torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=0.1))
        >>> m.index(b), m.lr(w), m.lr(torch.zeros(1))
        (1, 0.1, None)
    """

    def __init__(self, opt: Optional[torch.optim.Optimizer]) -> None:
        self.opt = opt
        self._of: Optional[dict[int, int]] = None

    def index(self, param: torch.Tensor) -> Optional[int]:
        """The index of the first param group that holds ``param`` (``None``: none does)."""
        if self.opt is None:
            return None
        if self._of is None:
            self._of = {}
            for g, group in enumerate(self.opt.param_groups):
                for p in group["params"]:
                    self._of.setdefault(id(p), g)
        return self._of.get(id(param))

    def lr(self, param: torch.Tensor) -> Optional[float]:
        """The ``lr`` of the group that holds ``param``, as a float (``None``: not known)."""
        g = self.index(param)
        if g is None or self.opt is None:
            return None
        lr = self.opt.param_groups[g].get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            return float(lr.item())
        return float(lr) if isinstance(lr, (int, float)) else None


_COMPENSATION_FLAGS = (
    "kahan_sum",
    "kahan_summation",
    "stochastic_rounding",
    "bf16_stochastic_round",
)
_COMPENSATION_STATE = ("kahan", "compensation", "comp_buf", "error_feedback")


def compensates(opt: Optional[torch.optim.Optimizer], param: torch.Tensor) -> bool:
    """Whether ``opt`` keeps the rounding error of ``param``'s low-precision updates.

    Kahan summation (optimi's ``kahan_sum=True``: a compensation buffer in the state),
    stochastic rounding (torchao's ``bf16_stochastic_round=True``): read from the param
    group's flags and the parameter's state keys, only when a finding is judged.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(1))
        >>> compensates(torch.optim.SGD([w], lr=0.1), w)
        False
    """
    if opt is None:
        return False
    for group in opt.param_groups:
        if any(p is param for p in group["params"]):
            if any(group.get(flag) for flag in _COMPENSATION_FLAGS):
                return True
            break
    state = opt.state.get(param, {}) if hasattr(opt, "state") else {}
    return any(any(s in str(k).lower() for s in _COMPENSATION_STATE) for k in state)
