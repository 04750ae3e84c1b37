"""Which sharding engine holds a model's parameters, and the names wrappers insert.

Pure inspection of the model (no hooks, no collectives): :mod:`gradwatch.distributed` builds
on it to read sharded gradients, and the layout (:mod:`gradwatch.model.index`) uses it to
name parameters as the user wrote them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = [
    "FSDP1_FLAT",
    "FSDP1_ORIG",
    "FSDP2",
    "WRAPPER_SEGMENTS",
    "clean_name",
    "engine_of",
    "flat_params",
    "local",
    "unwrap_fsdp1",
]


FSDP2 = "fsdp2"
FSDP1_ORIG = "fsdp1_orig"
FSDP1_FLAT = "fsdp1_flat"

WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Module-name segments that wrappers insert: the user never wrote them."""


try:  # torch.distributed may be missing from a build
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - builds without distributed
    _DTensor = None  # type: ignore[assignment,misc]


def clean_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``a._fsdp_wrapped_module.b`` -> ``a.b``).

    Example:
        >>> clean_name("_fsdp_wrapped_module.encoder._checkpoint_wrapped_module.weight")
        'encoder.weight'

    A named model's prefix (``watch({"G": netG, ...})``, :mod:`gradwatch.model.named`) is
    the first segment, ending in ``:``: ``G:.main.0.weight`` -> ``G:main.0.weight``, ``G:``
    (its root) -> ``G``. A ``:`` anywhere else is part of a user's name and stays.

        >>> clean_name("G:.main._orig_mod.0")
        'G:main.0'
    """
    if ":" in name:
        head, _, rest = name.partition(".")
        if head.endswith(":"):
            rest = clean_name(rest)
            return head + rest if rest else head[:-1]
    if "_" not in name or not any(s in name for s in WRAPPER_SEGMENTS):
        return name  # the common case: one substring scan, no split
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def _fsdp1_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed
        return None
    return FullyShardedDataParallel


def unwrap_fsdp1(model: nn.Module) -> Optional[nn.Module]:
    """The module inside an FSDP1 wrapper, or None when ``model`` is not one."""
    cls = _fsdp1_class()
    if cls is not None and isinstance(model, cls):
        inner = model.module
        return inner if isinstance(inner, nn.Module) else None
    return None


def engine_of(model: nn.Module) -> Optional[str]:
    """Which sharding engine holds ``model``'s parameters (``None``: not sharded)."""
    cls = _fsdp1_class()
    if cls is not None:
        for mod in model.modules():
            if isinstance(mod, cls):
                return FSDP1_ORIG if getattr(mod, "_use_orig_params", False) else FSDP1_FLAT
    for p in model.parameters():
        if _DTensor is not None and isinstance(p, _DTensor):
            return FSDP2
        # FSDP1 marks what it flattened: seen from inside a wrapper (Lightning watches the
        # LightningModule that its FSDP strategy wrapped) the mark is all there is.
        if getattr(p, "_fsdp_flattened", False):
            return FSDP1_FLAT if getattr(p, "_is_flat_param", False) else FSDP1_ORIG
    return None


def flat_params(model: nn.Module) -> list[torch.Tensor]:
    """FSDP1's flat parameters under ``model`` (their hooks fire once per backward)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for mod in model.modules():
        p = getattr(mod, "_flat_param", None)
        if isinstance(p, torch.Tensor) and id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t
