"""``ghost_param``'s groups: one cause, one finding (see :mod:`gradwatch.checks._grouping`).

The ghost layers of a step are grouped by cause: the layers one cut severed
(``disconnected``, linked by the forward's data flow, named by the cut), a whole module
subtree (``not_called``, ``no_grad``, ``unknown``), the optimizer's tensors that are no
longer in the model (``not_in_model``: a layer replaced after the optimizer was built,
named by the layer whose new parameters match their shapes), or a layer on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gradwatch.checks._grouping import WHOLE, by_flow, by_subtree, cut_point, label, trainable
from gradwatch.checks.views import ForwardOrder, StepView
from gradwatch.model.index import ParamIndex

__all__ = ["HINTS", "Group", "ghost_groups", "replaced_layers"]

HINTS = {
    "not_called": "Its module never ran: remove the unused layer or call it; if the branch is "
    "conditional, DDP needs find_unused_parameters=True. List it in `ignore` if intended.",
    "no_grad": "Its module ran with gradients disabled (torch.no_grad, torch.inference_mode, or a "
    "reentrant torch.utils.checkpoint whose inputs do not require grad: use "
    "checkpoint(..., use_reentrant=False)). Freeze it with requires_grad_(False) if intended.",
    "disconnected": "Its module ran with gradients enabled but its output never reached the loss: "
    "look for .detach(), .data, a .item()/.numpy() round trip, or an output nobody used "
    "(e.g. an ignored pooler).",
    "not_in_model": "The optimizer holds tensors that are no longer parameters of the model: a "
    "layer replaced after the optimizer was built (model.fc = nn.Linear(...)) leaves the optimizer "
    "with the old tensors while the new ones get gradients and never change. Build the optimizer "
    "after the model is complete, or add the new layer with optimizer.add_param_group().",
    "unknown": "No gradient reached it and its module could not be traced (a functional call or "
    "a parameter used outside its module). Check that it contributes to the loss.",
}


@dataclass
class Group:
    """The ghosts of one cause: one layer, a module subtree, or the layers one cut severed."""

    cause: str
    layers: list[str]
    positions: list[int]
    module: Optional[str]
    key: str
    cut: Optional[tuple[str, str]] = None  # (module whose output was cut, its last layer)
    details: dict[str, object] = field(default_factory=dict)

    replaced: Optional[list[str]] = None  # not_in_model: the layers whose new tensors match

    def message(self, n: int, lost: int, seen: int, step: int, where: str) -> str:
        when = f"in {lost} of {lost + seen} steps" if seen else f"at step {step}"
        noun = "parameter" if n == 1 else "parameters"
        if self.cause == "not_in_model":
            what = (
                f"the old parameters of {', '.join(repr(x) for x in self.replaced)} (same "
                "shapes), replaced after the optimizer was built"
                if self.replaced
                else "tensors that are no longer in the watched model"
            )
            return (
                f"the optimizer holds {n} {noun} that got no gradient {when}{where}: {what} "
                "(cause: not_in_model)."
            )
        if len(self.layers) == 1 and self.module == self.layers[0]:
            return f"{n} {noun} of '{self.module}' got no gradient {when}{where} (cause: {self.cause})."
        span = f"{len(self.layers)} layers"
        if self.cut is not None:
            return (
                f"{n} {noun} in {span} got no gradient {when}{where} (cause: {self.cause}): "
                f"cut off from the loss at the output of {label(self.cut[0])}."
            )
        return f"{n} {noun} in {span} of {label(self.module or '')} got no gradient {when}{where} (cause: {self.cause})."

    def hint(self) -> str:
        if self.cut is None:
            return HINTS.get(self.cause, HINTS["unknown"])
        module, last = self.cut
        return (
            f"The output of {label(module)} (its last layer to run: '{last}') never reaches "
            "the loss, and every layer before it loses its gradient with it: look for a "
            ".detach(), .data or a .item()/.numpy() round trip on it, or an output nobody "
            "used."
        )


def ghost_groups(view: StepView, flagged: list[tuple[str, list[int], str]]) -> list[Group]:
    """One cause, one group: the layers one cut severed (``disconnected``, by the forward's
    data flow), a whole module subtree (``not_called``, ``no_grad``, ``unknown``), or a
    layer on its own."""
    groups: list[Group] = []
    index = view.index
    outside = [k for _, ks, _ in flagged for k in ks if index.params[view.ids[k]].outside_model]
    if outside:
        layers = list(dict.fromkeys(index.params[view.ids[k]].layer for k in outside))
        old = [view.ids[k] for k in outside]
        replaced = replaced_layers(index, old)
        extra: dict[str, object] = {"replaced": replaced} if replaced else {}
        key = f"not_in_model:{view.optimizer}"
        groups.append(Group("not_in_model", layers, outside, None, key, None, extra, replaced))
        gone = set(layers)
        flagged = [(layer, ks, c) for layer, ks, c in flagged if layer not in gone]
    flagged, used_by = _functional(flagged)
    forward = view.forward
    if used_by:
        links = dict(forward.links)
        for child, owner in used_by.items():
            links[child] = links.get(child, frozenset()) | {owner}
        forward = ForwardOrder(forward.stamps, links)
    live_layers = list(dict.fromkeys(index.params[i].layer for i in trainable(index)))
    for cause, rows in _by_cause(flagged).items():
        pos = dict(rows)
        if cause == "disconnected":
            for layers in by_flow([layer for layer, _ in rows], forward):
                ks = [k for layer in layers for k in pos[layer]]
                if len(layers) == 1:
                    groups.append(Group(cause, layers, ks, layers[0], layers[0]))
                    continue
                cut = cut_point(layers, forward, live_layers)
                module = cut[0] if cut is not None else _common(layers)
                details: dict[str, object] = {"layers": layers}
                if cut is not None:
                    details.update(cut=cut[0], cut_layer=cut[1])
                groups.append(
                    Group(cause, layers, ks, module or None, module or WHOLE, cut, details)
                )
            continue
        ids_pos = {view.ids[k]: k for _, ks in rows for k in ks}
        for root, ids in by_subtree(index, list(ids_pos), trainable(index)).items():
            ks = [ids_pos[i] for i in ids]
            layers = list(dict.fromkeys(index.params[i].layer for i in ids))
            if len(layers) == 1 and root == layers[0]:
                groups.append(Group(cause, layers, ks, root, root))
            else:
                groups.append(
                    Group(cause, layers, ks, root or None, root or WHOLE, None, {"layers": layers})
                )
    return groups


def _common(layers: list[str]) -> str:
    """The longest module path every one of ``layers`` is under (``""``: the root)."""
    parts = [layer.split(".") for layer in layers]
    out = []
    for bits in zip(*parts):
        if len(set(bits)) != 1:
            break
        out.append(bits[0])
    return ".".join(out)


def _functional(
    flagged: list[tuple[str, list[int], str]],
) -> tuple[list[tuple[str, list[int], str]], dict[str, str]]:
    """A layer whose own forward never ran, inside a ghost layer that did, is used by that
    layer's forward functionally (``nn.MultiheadAttention`` reads ``out_proj.weight``
    without calling ``out_proj``): it shares the enclosing layer's cause and group.
    Returns the rows with those causes and ``child -> enclosing layer``."""
    causes = {layer: cause for layer, _, cause in flagged}
    used_by: dict[str, str] = {}
    out = []
    for layer, ks, cause in flagged:
        if cause == "not_called":
            parts = layer.split(".")
            owner = next(
                (
                    a
                    for a in (".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1))
                    if causes.get(a) not in (None, "not_called")
                ),
                None,
            )
            if owner is not None:
                used_by[layer] = owner
                cause = causes[owner]
        out.append((layer, ks, cause))
    return out, used_by


def _by_cause(flagged: list[tuple[str, list[int], str]]) -> dict[str, list[tuple[str, list[int]]]]:
    by_cause: dict[str, list[tuple[str, list[int]]]] = {}
    for layer, ks, cause in flagged:
        by_cause.setdefault(cause, []).append((layer, ks))
    return by_cause


def replaced_layers(index: ParamIndex, old: list[int]) -> list[str]:
    """The model's layers whose parameters in no optimizer have the shapes (and dtypes) of
    the optimizer's tensors ``old`` that left the model, matched one to one in order: the
    layers that replaced them. Empty when not every old tensor finds its match."""
    held = {i for i in old}
    candidates = []
    for i in trainable(index):
        if i in held:
            continue
        p = index.params[i].ref()
        if p is not None:
            candidates.append((i, tuple(p.shape), p.dtype))
    taken: set[int] = set()
    layers: list[str] = []
    for i in old:
        p = index.params[i].ref()
        if p is None:
            return []
        match = next(
            (
                c
                for c, shape, dtype in candidates
                if c not in taken and shape == tuple(p.shape) and dtype == p.dtype
            ),
            None,
        )
        if match is None:
            return []
        taken.add(match)
        layers.append(index.params[match].layer)
    return list(dict.fromkeys(layers))
