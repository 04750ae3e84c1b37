"""Which parameters a finding names (SPEC 8.1: every finding names its parameters), for the
checks whose evidence is a module, a param group or a node of the loss's graph rather than
the parameters themselves.

Named so, ``ignore`` by parameter silences such a finding (when it matches every one),
baselines key it, and SARIF and the console list them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from gradwatch.capture.loss.graph_walk import GraphDesc
from gradwatch.checks.views import StepView
from gradwatch.model.engines import clean_name
from gradwatch.model.index import ROOT, ParamIndex

__all__ = ["group_params", "term_params", "under", "upstream"]


def under(index: ParamIndex, modules: Iterable[str]) -> list[str]:
    """Every name of the model's parameters inside one of ``modules`` (``""`` or the root:
    all), at every place they are registered (a module shared by several places is listed
    under each: its parameters are one, named under every path)."""
    paths = [clean_name(m) for m in modules]
    if any(m in ("", ROOT) for m in paths):
        ids = [i.idx for i in index.params if not i.outside_model]
        return index.names(ids)
    prefixes = tuple(m + "." for m in paths)
    return [
        n for i in index.params if not i.outside_model for n in i.names if n.startswith(prefixes)
    ]


def upstream(index: ParamIndex, g: GraphDesc, i: int, module: Optional[str] = None) -> list[str]:
    """The parameters upstream of node ``i`` of the loss's graph: the leaves it reaches, by
    identity, and (``module``) the parameters of the module the finding names. When the walk
    was cut short (``g.truncated``), also those of every module whose output it reaches."""
    ids: list[int] = []
    modules = [module] if module is not None else []
    seen, stack = {i}, [i]
    while stack:
        node = g.nodes[stack.pop()]
        tensor = node.variable() if node.variable is not None else None
        found = index.lookup(tensor) if tensor is not None else None
        if found is not None:
            ids.append(found)
        if g.truncated and node.mark is not None and node.mark.params:
            modules.append(node.mark.module)
        for j in node.inputs:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    names = index.names(sorted(ids))
    extra = [n for n in under(index, modules) if n not in names] if modules else []
    return names + extra


def group_params(view: StepView, optimizer: int, group: int) -> list[str]:
    """The parameters of param group ``group`` of watched optimizer ``optimizer``."""
    built = view.window.records.get("built")
    for info in getattr(built, "groups", None) or ():
        if info.optimizer == optimizer and info.group == group:
            return list(dict.fromkeys(n for names in info.names.values() for n in names))
    if optimizer == view.optimizer:
        return view.index.names(view.group_ids(group))
    return []


def term_params(index: ParamIndex, graphs: list[GraphDesc], terms: int, k: int) -> list[str]:
    """The parameters upstream of term ``k`` of a summed loss of ``terms`` terms (the first
    of the window's graphs that sums that many: the one its terms were read from)."""
    for g in graphs:
        roots = g.terms()
        if len(roots) == terms:
            return upstream(index, g, roots[k])
    return []
