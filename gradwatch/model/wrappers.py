"""The user's module inside the wrappers that training frameworks put around it.

DDP and DataParallel (``.module``), FSDP1 (``distributed/sharded.py``), ``torch.compile``
(``._orig_mod``), Lightning Fabric's ``_FabricModule`` (``._forward_module``) and Opacus's
``GradSampleModule`` (``._module``). The last two are recognised by attribute or class name:
the core imports neither library. gradwatch watches the inner module, so
findings carry the user's own parameter names, without the wrappers' prefixes.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from gradwatch.model.engines import unwrap_fsdp1

__all__ = ["ddp_find_unused", "unwrap"]


def _fabric_inner(model: nn.Module) -> Optional[nn.Module]:
    """The module inside Lightning Fabric's ``_FabricModule`` (``fabric.setup``), else None.

    Read by its attribute, not its class: the core never imports Lightning.
    """
    inner = getattr(model, "_forward_module", None)
    if isinstance(inner, nn.Module) and isinstance(
        getattr(model, "_original_module", None), nn.Module
    ):
        return inner
    return None


def _opacus_inner(model: nn.Module) -> Optional[nn.Module]:
    """The module inside Opacus's ``GradSampleModule`` (``make_private``), else None."""
    if any(c.__name__ == "AbstractGradSampleModule" for c in type(model).__mro__):
        inner = getattr(model, "_module", None)
        return inner if isinstance(inner, nn.Module) else None
    return None


def _one_in(model: nn.Module) -> Optional[nn.Module]:
    """The module one wrapper in (DDP, DataParallel, Fabric, Opacus, compile), else None."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    # isinstance, never ``or``: an empty ``nn.Sequential`` is falsy.
    for inner in (_fabric_inner(model), _opacus_inner(model), getattr(model, "_orig_mod", None)):
        if isinstance(inner, nn.Module):
            return inner
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel/FSDP1/``torch.compile``/Fabric/Opacus."""
    while True:
        inner = _one_in(model)
        if inner is None:
            inner = unwrap_fsdp1(model)
        if inner is None:
            return model
        model = inner


def ddp_find_unused(model: nn.Module) -> Optional[bool]:
    """``find_unused_parameters`` of the DDP wrapper in ``model`` (``None``: no DDP wrapper).

    Read before unwrapping: an intermittent ghost is harmless with it and crashes DDP
    without it.
    """
    current: Optional[nn.Module] = model
    while current is not None:
        if isinstance(current, nn.parallel.DistributedDataParallel):
            return bool(current.find_unused_parameters)
        current = _one_in(current)
    return None
