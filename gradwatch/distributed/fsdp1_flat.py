"""FSDP1 with flattened parameters: each original parameter read from its slice of the flat shard.

What the mechanism gives us (torch 2.13, gloo, checked on 2 CPU ranks): FSDP1's default
(``use_orig_params=False``) replaces the parameters of each wrapped unit by one
``FlatParameter`` holding this rank's contiguous shard of their concatenation; the original
modules keep no parameter of their own. The flat parameter keeps the layout:

- ``_param_infos[j]``: the module that owned original parameter ``j`` (the object itself, so
  its name in the watched model is found without string surgery) and its attribute name;
- ``_numels[j]``: its full size; ``_shard_param_infos[j]``: whether this rank's shard holds
  a piece of it (``in_shard``) and where (``offset_in_shard``, ``numel_in_shard``);
- ``_shared_param_infos``: tied parameters (one slice, several names).

After backward the flat parameter's ``.grad`` is this rank's shard of the reduce-scattered
gradient, laid out like the parameter: each original parameter's statistics come from its
slice (a view, never a copy), and the pieces of all ranks add up to the whole parameter in
the existing collective (:mod:`gradwatch.distributed.sharded`). An unused original parameter gets a
zero slice, as under ``use_orig_params=True``: a ghost is told by its module's forward hooks.

Where the metadata is missing or does not add up, nothing is guessed: the flat parameter is
judged as one tensor and a ``not_observed`` error says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from gradwatch.capture.grads.window import Track
from gradwatch.measure.fingerprint import Fingerprint, fingerprint
from gradwatch.model.engines import clean_name, local
from gradwatch.model.index import ROOT, ParamIndex

if TYPE_CHECKING:
    from gradwatch.capture.grads.hooks import HookSet
    from gradwatch.capture.grads.window import Track

__all__ = [
    "FlatLayout",
    "Original",
    "adopt",
    "fingerprint_track",
    "grad_pieces",
    "read_flat",
    "shard_pieces",
]


@dataclass
class Original:
    """One original parameter inside a flat parameter, as this rank holds it."""

    names: list[str]
    layer: str
    owners: list[str]
    numel: int  # the whole parameter's
    offset: int  # in this rank's shard
    count: int  # elements of it in this rank's shard (0: none)
    modules: list[nn.Module]


@dataclass
class FlatLayout:
    """The watched model's flat parameters: which index entries replace each of them."""

    originals: dict[int, list[int]] = field(default_factory=dict)
    """Flat parameter's index -> the index entries of its original parameters."""
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Original parameter's index -> (offset, count) in its flat parameter's local shard."""
    unreadable: dict[int, str] = field(default_factory=dict)
    """Flat parameter's index -> why its layout cannot be read (judged as one tensor)."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_flat(fp: torch.Tensor, names: dict[int, str]) -> tuple[list[Original], Optional[str]]:
    """The original parameters inside flat parameter ``fp`` (``names``: id(module) -> name).

    Returns ``([], problem)`` when the metadata is missing or does not add up.
    """
    infos = getattr(fp, "_param_infos", None)
    shard = getattr(fp, "_shard_param_infos", None)
    numels = getattr(fp, "_numels", None)
    shared = getattr(fp, "_shared_param_infos", ())
    if infos is None or shard is None or numels is None:
        return [], "the flat parameter has no _param_infos/_shard_param_infos/_numels"
    if not (len(infos) == len(shard) == len(numels)) or not infos:
        return [], "the flat parameter's metadata lists differ in length"
    out: list[Original] = []
    size = local(fp).numel()
    taken: list[tuple[int, int]] = []
    try:
        for info, si, n in zip(infos, shard, numels):
            name = names.get(id(info.module))
            if name is None or not _int(n):
                return [], f"module of '{info.param_name}' is not in the watched model"
            offset, count = (si.offset_in_shard, si.numel_in_shard) if si.in_shard else (0, 0)
            if not (_int(offset) and _int(count)) or offset + count > size or count > n:
                return [], f"slice of '{name}.{info.param_name}' lies outside the shard"
            if count:
                taken.append((offset, count))
            layer = name or ROOT
            names_ = [_join(name, info.param_name)]
            out.append(Original(names_, layer, [layer], n, offset, count, [info.module]))
        for s in shared:  # a tied parameter: one slice, more names and owners
            prim = names.get(id(s.prim_module))
            other = names.get(id(s.module))
            if prim is None or other is None:
                return [], f"module of tied '{s.param_name}' is not in the watched model"
            target = next((o for o in out if o.names[0] == _join(prim, s.prim_param_name)), None)
            if target is None:
                return [], f"tied '{s.param_name}' has no primary parameter in the flat layout"
            target.names.append(_join(other, s.param_name))
            if (other or ROOT) not in target.owners:
                target.owners.append(other or ROOT)
                target.modules.append(s.module)
    except (AttributeError, TypeError, ValueError) as exc:  # a layout this torch lacks
        return [], f"unexpected flat parameter metadata ({type(exc).__name__}: {exc})"
    padded = getattr(fp, "_shard_numel_padded", None)
    if isinstance(padded, int) and sum(c for _, c in taken) + padded != size:
        return [], "the original parameters' slices do not fill the shard"
    taken.sort()
    for (a, m), (b, _) in zip(taken, taken[1:]):
        if a + m > b:
            return [], "original parameters' slices overlap in the shard"
    return out, None


def _join(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


def adopt(
    model: nn.Module, index: ParamIndex, tracks: Sequence[Track], hooks: HookSet, lay: FlatLayout
) -> FlatLayout:
    """Replace every readable flat parameter by its originals: in the index, the tracks, hooks.

    Idempotent: run after each layout re-read. New index entries are ``within`` their flat
    parameter (never hooked themselves); the flat parameter leaves the report's layers.
    """
    names: Optional[dict[int, str]] = None
    for info in list(index.params):
        p = info.ref()
        if (
            p is None
            or info.within is not None
            or not getattr(p, "_is_flat_param", False)
            or info.idx in lay.originals
            or info.idx in lay.unreadable
        ):
            continue
        if names is None:
            names = {}
            for name, mod in model.named_modules(remove_duplicate=False):
                names.setdefault(id(mod), clean_name(name))
        originals, problem = read_flat(p, names)
        if problem is not None:
            lay.unreadable[info.idx] = problem
            continue
        ids = []
        for o in originals:
            i = index.register_within(info.idx, o.names, o.layer, o.owners, o.numel)
            lay.spans[i] = (o.offset, o.count)
            ids.append(i)
            for owner, mod in zip(o.owners, o.modules):
                hooks.hook_layer(owner, mod)  # ghost causes: its forward's grad mode
        lay.originals[info.idx] = ids
    for flat, ids in lay.originals.items():  # again after each re-scan (it re-adds the name)
        index.hide(flat, [n for i in ids for n in index.params[i].names])
    for track in tracks:
        _translate(track, lay, index)
    return lay


def _translate(track: Track, lay: FlatLayout, index: ParamIndex) -> None:
    """A track's flat parameters -> their originals (each with the flat tensor as its own)."""
    orig = lay.originals
    if any(i in orig for i in track.ids):
        ids: list[int] = []
        params: list[torch.Tensor] = []
        for i, p in zip(track.ids, track.params):
            inner = orig.get(i, [i])
            ids.extend(inner)
            params.extend([p] * len(inner))
        track.set_params(ids, params, [index.params[i].layer for i in ids])
    if any(i in orig for i in track.frozen_ids):
        held = [(j, p) for i, p in zip(track.frozen_ids, track.frozen) for j in orig.get(i, [i])]
        track.set_frozen(held)
    track.flat_spans = lay.spans if lay.spans else None


def shard_pieces(
    tensors: list[torch.Tensor], ids: list[int], spans: Optional[dict[int, tuple[int, int]]]
) -> list[torch.Tensor]:
    """This rank's piece of each tensor: a DTensor's local shard, an original's flat slice.

    Views, never copies; the same objects while the flat storage stays (fingerprints are
    keyed by tensor identity). A piece may be empty (this rank holds none of it).
    """
    if not spans:
        return [local(t) for t in tensors]
    return [_piece(local(t), spans.get(i)) for t, i in zip(tensors, ids)]


# id(flat shard) -> (its weakref, data pointer, span -> view): the same view objects each step
_VIEWS: dict[int, tuple[weakref.ref[torch.Tensor], int, dict[tuple[int, int], torch.Tensor]]] = {}


def _piece(t: torch.Tensor, span: Optional[tuple[int, int]]) -> torch.Tensor:
    if span is None:
        return t
    ptr = t.data_ptr()
    found = _VIEWS.get(id(t))
    if found is None or found[0]() is not t or found[1] != ptr:
        # new, or FSDP swapped the storage (views of the old one would read stale values)
        if len(_VIEWS) > 4096:
            _VIEWS.clear()
        found = _VIEWS[id(t)] = (weakref.ref(t), ptr, {})
    view = found[2].get(span)
    if view is None:
        offset, count = span
        view = found[2][span] = t.detach().reshape(-1)[offset : offset + count]
    return view


def grad_pieces(
    grads: list[Optional[torch.Tensor]],
    ids: list[int],
    spans: Optional[dict[int, tuple[int, int]]],
    like: list[torch.Tensor],
) -> list[torch.Tensor]:
    """This rank's piece of each gradient (an empty tensor where it holds none)."""
    out = []
    for g, i, lp in zip(grads, ids, like):
        if g is None:
            out.append(lp.new_zeros(0))
            continue
        lg = local(g)
        span = spans.get(i) if spans else None
        out.append(lg if span is None else lg.reshape(-1)[span[0] : span[0] + span[1]])
    return out


def fingerprint_track(track: Track) -> None:
    """Fingerprints, not copies: a few numbers per tensor (measure/fingerprint.py)."""
    if track.sharded is not None:  # this rank's pieces (views), never a gather or a copy
        spans = track.flat_spans
        track.pieces = shard_pieces(track.params, track.ids, spans)
        track.frozen_pieces = shard_pieces(track.frozen, track.frozen_ids, spans)
        track.fingerprint = _fingerprint(track.pieces)
        track.frozen_fp = _fingerprint(track.frozen_pieces) if track.frozen else None
        return
    if track.frozen and not ParamIndex.any_uninitialized(track.frozen):
        track.frozen_fp = _fingerprint(track.frozen)
    if not track.params or ParamIndex.any_uninitialized(track.params):
        return  # no update ratio while a lazy parameter has no values yet
    # this step's number: the last step's after-reading serves where nothing wrote since
    track.fingerprint = _fingerprint(track.params, track.steps)


def _fingerprint(params: list[torch.Tensor], step: Optional[int] = None) -> Optional[Fingerprint]:
    try:
        return fingerprint(params, step)
    except (ValueError, RuntimeError, TypeError, NotImplementedError):
        return None  # a tensor type it cannot read (a sharded subclass): no update ratio
