"""One root cause, one finding: the layers a check flags for one cause, grouped.

Two rules, shared by the checks that flag layers by the dozen for one mistake:

- :func:`by_subtree`: flagged parameters that fill a whole module subtree (every trainable
  parameter under it is flagged) are one group named by the highest such module: a decoder
  left out of the optimizer is ``encoder``, not its 37 layers. A layer only partly flagged
  is its own group, as before.
- :func:`by_flow`: layers cut off by one ``.detach()`` are linked by the forward's data flow
  (``ForwardOrder.links``, read from autograd's graph): linked layers are one group, two
  independent branches are two. :func:`cut_point` names the module whose output was cut:
  the group's last layer to run, promoted to the highest module that holds only the group's
  layers and that this layer ends.

The whole model is named ``""`` (``the whole model`` in messages).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from gradwatch.checks.views import ForwardOrder
from gradwatch.model.index import ROOT, ParamIndex

__all__ = ["WHOLE", "by_flow", "by_subtree", "cut_point", "label", "numel_of", "trainable"]


WHOLE = "(whole model)"  # the key of a group that is the whole model


def label(module: str) -> str:
    """How a message names a group's module: ``'encoder'``, or ``the whole model``."""
    return "the whole model" if module == "" else f"'{module}'"


def ancestors(layer: str) -> list[str]:
    """``""``, ``"a"``, ``"a.b"``, ..., ``layer`` itself: shortest first."""
    if layer == ROOT:
        return ["", ROOT]
    parts = layer.split(".")
    return ["", *(".".join(parts[: k + 1]) for k in range(len(parts)))]


def trainable(index: ParamIndex) -> list[int]:
    """The model's live trainable parameters (not the optimizer's tensors outside it)."""
    out = []
    for info in index.params:
        p = info.ref()
        if p is not None and p.requires_grad and not info.outside_model:
            out.append(info.idx)
    return out


def numel_of(index: ParamIndex, ids: Iterable[int]) -> int:
    """Elements of the parameters ``ids``."""
    return sum(index.params[i].numel for i in ids)


def by_subtree(
    index: ParamIndex, flagged: list[int], universe: Iterable[int]
) -> dict[str, list[int]]:
    """``module -> flagged ids`` grouped by the highest module whose trainable parameters
    (those in ``universe``) are all flagged; a partly flagged layer is its own group."""
    hit: dict[str, int] = {}
    total: dict[str, int] = {}
    chosen = set(flagged)
    for i in set(universe) | chosen:
        for a in ancestors(index.params[i].layer):
            total[a] = total.get(a, 0) + 1
            if i in chosen:
                hit[a] = hit.get(a, 0) + 1
    out: dict[str, list[int]] = {}
    for i in flagged:
        layer = index.params[i].layer
        root = next((a for a in ancestors(layer) if hit.get(a, 0) == total[a]), layer)
        out.setdefault(root, []).append(i)
    return out


def by_flow(layers: list[str], forward: ForwardOrder) -> list[list[str]]:
    """``layers`` split into the groups that the forward's data flow links (in the order
    given). A layer the flow does not know (not seen in the first window) is its own group."""
    parent = {layer: layer for layer in layers}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for layer in layers:
        for up in forward.links.get(layer, ()):
            if up in parent:
                a, b = find(layer), find(up)
                if a != b:
                    parent[b] = a
    groups: dict[str, list[str]] = {}
    for layer in layers:
        groups.setdefault(find(layer), []).append(layer)
    return list(groups.values())


def cut_point(
    group: list[str], forward: ForwardOrder, layer_names: Iterable[str]
) -> Optional[tuple[str, str]]:
    """``(module, last layer)``: where the group was cut off from the loss, when the forward's
    stamps can tell (``None``: they cannot, e.g. hooks off or a compiled model).

    The last layer of the group to run is the one whose output (or its container's) was
    detached; the module named is the highest one that holds only the group's layers among
    ``layer_names`` (every layer with trainable parameters) and whose last layer to run is
    that one: ``blocks`` for ``self.blocks(x).detach()``.
    """
    stamps = forward.stamps
    ran = [layer for layer in group if layer in stamps]
    if not ran:
        return None
    last = max(ran, key=lambda layer: stamps[layer])
    members = set(group)
    names = list(layer_names)
    module = last
    for a in ancestors(last):
        if a == "" or a == last:
            continue
        inside = [n for n in names if n == a or n.startswith(a + ".")]
        if (
            all(n in members for n in inside)
            and max((stamps.get(n, 0) for n in inside), default=0) <= stamps[last]
        ):
            module = a
            break
    return module, last
