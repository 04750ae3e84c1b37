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

from gradwatch.model.locations import declares

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
    """Module name -> the package whose model holds it, for every library-owned module.

    Only when the watched model itself is the library's: a user's model around one (a head
    on a BERT, leaving its pooler out) decided what to discard, and plain DDP crashes on it.
    The library's own code must have made the module and must run it: a child a library
    class does not assign in its source (a head the user set on the model) is the user's,
    and so is everything under a module whose ``forward`` the user replaced on the instance.
    """
    out: dict[str, str] = {}
    if package_of(type(model)) is None:
        return out  # the user's own model around a library's: what it discards is its call
    # name -> (package of the nearest library ancestor or None, whether the chain is clean)
    state: dict[str, tuple[Optional[str], bool]] = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        own = package_of(type(module))
        pkg: Optional[str]
        if name == "":
            clean = own is not None or _neutral(type(model))
            state[name] = (own, clean and "forward" not in vars(module))
            continue
        parent_name, _, attr = name.rpartition(".")
        above, clean = state.get(parent_name, (None, False))
        parent = modules.get(parent_name)
        if clean and above is not None and parent is not None:
            if package_of(type(parent)) is not None and not declares(parent, attr):
                clean = False  # set on the library's model from outside: the user's
            elif "forward" not in vars(module):  # else the user's code runs there
                out[name] = above
        if own is not None:
            pkg, clean = (above or own), (clean if above is not None else True)
        else:
            pkg, clean = above, clean and _neutral(type(module))
        state[name] = (pkg, clean and "forward" not in vars(module))
    return out
