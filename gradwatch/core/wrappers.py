"""The user's module inside the wrappers that training frameworks put around it.

DDP and DataParallel (``.module``), FSDP1 (``core/sharded.py``), ``torch.compile``
(``._orig_mod``) and Lightning Fabric's ``_FabricModule`` (``._forward_module``, read by its
attributes: the core never imports Lightning). gradwatch watches the inner module, so
findings carry the user's own parameter names, without the wrappers' prefixes.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from gradwatch.core.sharded import unwrap_fsdp1

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


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel/FSDP1/``torch.compile``/Fabric wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif (fabric := _fabric_inner(model)) is not None:
            model = fabric
        elif (inner := unwrap_fsdp1(model)) is not None:
            model = inner
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def ddp_find_unused(model: nn.Module) -> Optional[bool]:
    """``find_unused_parameters`` of the DDP wrapper in ``model`` (``None``: no DDP wrapper).

    Read before unwrapping: an intermittent ghost is harmless with it and crashes DDP
    without it.
    """
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return bool(model.find_unused_parameters)
        if isinstance(model, nn.DataParallel):
            model = model.module
        elif (fabric := _fabric_inner(model)) is not None:
            model = fabric
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return None
