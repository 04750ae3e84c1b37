"""The model as built: modules registered at several places, ties that are not ties.

Read once per layout (at enter, ``add_optimizer``, ``add_param_group``, a replaced layer),
from the module tree and the parameters' storages; no tensor data is touched.

- :func:`shared_modules`: one module object with parameters registered at several sibling
  places: several slots of one container (``nn.ModuleList([Block(d)] * n)``), or the same
  attribute of several parents of one class (one ``norm`` passed to every layer's
  constructor). A module registered once and applied several times (ALBERT, a Siamese
  encoder) is no finding, nor is an alias under another name (``self.backbone =
  self.model.encoder``) or a tied parameter.
- :func:`storage_aliases`: distinct ``Parameter`` objects over the very same memory
  (``load_state_dict(assign=True)`` of tied weights): the optimizer steps each of them.
- :func:`declared_ties_broken`: a model that declares its input and output embeddings tied
  (Hugging Face's ``config.tie_word_embeddings``) whose two weights are different objects.

Example:
    >>> from torch import nn
    >>> block = nn.Linear(4, 4)
    >>> [s.paths for s in shared_modules(nn.ModuleList([block] * 3))]
    [('0', '1', '2')]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from gradwatch.model.engines import clean_name

__all__ = ["BrokenTie", "SharedModule", "declared_ties_broken", "shared_modules", "storage_aliases"]


@dataclass(frozen=True)
class SharedModule:
    """One module object registered at several sibling places."""

    cls: str  # its class name
    paths: tuple[str, ...]  # every place it is registered at
    container: str  # the common parent's path (the slots' container, or the parents' parent)
    numel: int  # its parameters' elements (what the user meant to have ``len(paths)`` times)


@dataclass(frozen=True)
class BrokenTie:
    """Parameters meant to be one that are two objects."""

    names: tuple[str, ...]
    how: str  # "storage": distinct Parameters over one storage; "declared": the model says tied
    model: str = ""  # for "declared": the module that declares the tie


def _parent(path: str) -> tuple[str, str]:
    head, _, last = path.rpartition(".")
    return head, last


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if not _lazy(p))


def _lazy(p: torch.Tensor) -> bool:
    return isinstance(p, nn.parameter.UninitializedParameter)


def _places(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """``id(module) -> (module, every path it is registered at)`` for modules with
    parameters that are registered more than once."""
    seen: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if not name or not any(True for _ in mod.parameters(recurse=True)):
            continue
        entry = seen.setdefault(id(mod), (mod, []))
        entry[1].append(clean_name(name))
    return {k: v for k, v in seen.items() if len(set(v[1])) > 1}


def _outermost(paths: list[str]) -> list[str]:
    """The paths not inside another of them (a shared block's own children repeat with it)."""
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def shared_modules(model: nn.Module) -> list[SharedModule]:
    """Modules registered at several sibling places of ``model`` (see the module docstring)."""
    places = _places(model)
    out: list[SharedModule] = []
    covered: set[str] = set()
    by_path = dict(model.named_modules(remove_duplicate=False))
    for mod, paths in sorted(places.values(), key=lambda e: min(e[1])):
        paths = sorted(set(paths), key=paths.index)
        if any(p.startswith(c + ".") for p in paths for c in covered):
            continue  # inside a shared module already reported (its children repeat with it)
        sibling = _siblings(paths, by_path)
        if sibling is None:
            continue
        container, group = sibling
        covered.update(group)
        out.append(SharedModule(type(mod).__name__, tuple(group), container, _numel(mod)))
    return out


def _siblings(paths: list[str], by_path: dict[str, nn.Module]) -> Optional[tuple[str, list[str]]]:
    """The sibling places among ``paths``: slots of one parent, or one attribute of several
    parents of one class under one container. ``None``: aliases under unrelated names."""
    by_parent: dict[str, list[str]] = {}
    by_attr: dict[tuple[str, str, type], list[str]] = {}
    for p in paths:
        head, last = _parent(p)
        by_parent.setdefault(head, []).append(p)
        parent = by_path.get(head) if head else None
        if parent is not None:
            grand, _ = _parent(head)
            by_attr.setdefault((grand, last, type(parent)), []).append(p)
    for head, group in by_parent.items():
        if len(group) > 1:
            return head, group
    for (grand, _, _), group in by_attr.items():
        if len(group) > 1:
            return grand, group
    return None


def _region(p: torch.Tensor) -> Optional[tuple[Any, ...]]:
    """The exact memory a dense tensor covers (``None``: no storage to compare)."""
    if p.is_meta or p.layout != torch.strided or _lazy(p) or type(p) not in (nn.Parameter,):
        return None
    try:
        ptr = p.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if not ptr:
        return None
    return (p.device, ptr, p.storage_offset(), tuple(p.shape), tuple(p.stride()), p.dtype)


def storage_aliases(named: Iterator[tuple[str, torch.Tensor]]) -> list[BrokenTie]:
    """Distinct parameter objects over the very same memory region (each one is stepped).

    Views of one flat buffer at different offsets (contiguous-parameter optimizers) cover
    different regions and are no finding; a tied parameter is one object.
    """
    regions: dict[tuple[Any, ...], dict[int, list[str]]] = {}
    for name, p in named:
        key = _region(p)
        if key is not None:
            regions.setdefault(key, {}).setdefault(id(p), []).append(name)
    out = []
    for objects in regions.values():
        if len(objects) > 1:
            out.append(BrokenTie(tuple(n for names in objects.values() for n in names), "storage"))
    return out


def _embedding_weight(module: Any, getter: str) -> Optional[torch.Tensor]:
    try:
        emb = getattr(module, getter)()
    except Exception:  # a model whose getter raises (not implemented) declares nothing
        return None
    weight = getattr(emb, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _tie_target(mod: nn.Module, outp: torch.Tensor) -> Optional[torch.Tensor]:
    """What the class's ``_tied_weights_keys`` (transformers 5: output key -> source key)
    ties ``outp`` to; ``None`` when it names no tie for it (Luke's masked LM ties its
    entity head only, T5Gemma its decoder's embedding, not the encoder's)."""
    keys: dict[str, str] = mod._tied_weights_keys  # type: ignore[assignment]
    for name, p in mod.named_parameters(remove_duplicate=False):
        if p is outp and name in keys:
            try:
                return mod.get_parameter(keys[name])
            except AttributeError:
                return None
    return None


def declared_ties_broken(model: nn.Module) -> list[BrokenTie]:
    """Modules that declare their input and output embeddings tied whose weights differ.

    The declaration is Hugging Face's: ``config.tie_word_embeddings`` (the default of
    ``PretrainedConfig``), on a module with ``get_input_embeddings``/``get_output_embeddings``.
    A model without an output embedding, or with differently shaped ones, declares nothing.
    """
    names = {id(p): clean_name(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out: list[BrokenTie] = []
    for path, mod in model.named_modules():
        config = getattr(mod, "config", None)
        if not getattr(config, "tie_word_embeddings", False) or not hasattr(
            mod, "get_output_embeddings"
        ):
            continue
        inp = _embedding_weight(mod, "get_input_embeddings")
        outp = _embedding_weight(mod, "get_output_embeddings")
        if outp is not None and isinstance(getattr(mod, "_tied_weights_keys", None), dict):
            inp = _tie_target(mod, outp)
        if inp is None or outp is None or inp is outp or inp.shape != outp.shape:
            continue
        pair = tuple(names.get(id(t), "?") for t in (inp, outp))
        out.append(BrokenTie(pair, "declared", clean_name(path) or "(root)"))
        break  # the outermost declaring model (its inner base model repeats it)
    return out
