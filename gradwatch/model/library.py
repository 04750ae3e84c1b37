"""Which modules a third-party library's own model holds below its top (SPEC 8.1).

A Hugging Face model's forward leaves parts of itself out by design: the pooler of a masked
LM, the cross-attention of a decoder run alone, a vision tower fed text, a sparse-attention
indexer run under ``no_grad``. The user wrote none of that code: the parameters are the
library's, and so is the decision (Hugging Face's Trainer turns on DDP's
``find_unused_parameters`` for its models for this reason). A module is *library-owned* when
a library class above it holds it, with only library or torch classes in between; the top
library module itself is not (leaving it out, under ``no_grad`` or unused, is the user's
call).
"""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

__all__ = ["library_owned", "package_of"]

_NEUTRAL = ("torch", "gradwatch", "__main__", "builtins")


def package_of(cls: type) -> Optional[str]:
    """The installed third-party package that defines ``cls``, or ``None`` (torch, gradwatch,
    the user's own code: anything not under site-packages/dist-packages)."""
    top = cls.__module__.partition(".")[0]
    if top in _NEUTRAL:
        return None
    mod = sys.modules.get(cls.__module__)
    path = getattr(mod, "__file__", None) or ""
    if "site-packages" not in path and "dist-packages" not in path:
        return None
    return top


def _neutral(cls: type) -> bool:
    return cls.__module__.partition(".")[0] in _NEUTRAL


def library_owned(model: nn.Module) -> dict[str, str]:
    """Module name -> the package whose model holds it, for every library-owned module."""
    out: dict[str, str] = {}
    # name -> (package of the nearest library ancestor or None, whether the chain is clean)
    state: dict[str, tuple[Optional[str], bool]] = {}
    for name, module in model.named_modules():
        if name == "":
            pkg = package_of(type(model))
            state[name] = (pkg, pkg is not None or _neutral(type(model)))
            continue
        parent, _, _ = name.rpartition(".")
        above, clean = state.get(parent, (None, False))
        if above is not None and clean:
            out[name] = above
        own = package_of(type(module))
        if own is not None:
            state[name] = (above or own, clean if above is not None else True)
        else:
            state[name] = (above, clean and _neutral(type(module)))
    return out
