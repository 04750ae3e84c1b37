"""Which modules of a third-party library's own model its own code made and runs (SPEC 8.1).

A Hugging Face model's forward leaves parts of itself out by design: the pooler of a masked
LM, the cross-attention of a decoder run alone, a vision tower fed text, a sparse-attention
indexer run under ``no_grad``. When the watched model is the library's, the user wrote none
of that code: the parameters are the library's, and so is the decision (Hugging Face's
Trainer turns on DDP's ``find_unused_parameters`` for its models for this reason).
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
    """Module name -> the package of ``model``, for every module its library's code made
    and runs.

    Only when the watched model itself is the library's: a user's model around one (a head
    on a BERT, leaving its pooler out) decided what to discard, and plain DDP crashes on it.
    Below, a module is the library's while every module above it is a library or torch class
    whose ``forward`` the user did not replace on the instance, and each library parent's
    class assigns the child in its source (a head the user set on the model is the user's).
    """
    pkg = package_of(type(model))
    if pkg is None:
        return {}  # the user's own model around a library's: what it discards is its call
    out: dict[str, str] = {}
    modules = dict(model.named_modules())
    clean = {"": "forward" not in vars(model)}  # name -> its children may be the library's
    for name, module in modules.items():
        if name == "":
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name]
        ok = clean.get(parent_name, False) and "forward" not in vars(module)
        if ok and package_of(type(parent)) is not None and not declares(parent, attr):
            ok = False  # set on the library's model from outside: the user's
        if ok:
            out[name] = pkg
        own = type(module)
        clean[name] = ok and (package_of(own) is not None or _neutral(own))
    return out
