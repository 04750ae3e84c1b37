"""A batch that declares a graph over its samples: a full-graph GNN's nodes are its batch.

A GCN trained on a whole graph (Kipf & Welling, 2017) takes the node features ``(N, F)`` and
the graph, as an adjacency ``(N, N)`` (sparse, or dense and graph-like: non-negative,
not complete, symmetric or 0/1) or a PyG-style
``edge_index`` ``(2, E)`` of node numbers below ``N``. A node's output then depends on its
neighbours' inputs by design, within as many hops as the model has layers. The evidence
that tells it from a bug: every other sample the output reaches lies within ``k`` hops of
the declared edges, ``k`` at most the model's layers with parameters. A softmax or a mean
over the batch reaches nodes no edge path of that length connects, and stays a finding.
The graph may also be the model's: a fixed adjacency it holds as a buffer or attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["declared_graph", "hops_needed", "layers_with_parameters", "nodes_of_edge_batch"]


def _tensors(batch: Any, path: str) -> list[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [x for k, v in batch.items() for x in _tensors(v, f"{path}[{k!r}]")]
    if isinstance(batch, (list, tuple)):
        return [x for i, v in enumerate(batch) for x in _tensors(v, f"{path}[{i}]")]
    return []


def _adjacency(t: Tensor, n: int) -> Optional[Tensor]:
    """``t`` as an ``(n, n)`` boolean adjacency, symmetric and with self-loops, or None."""
    if t.dim() != 2 or n < 2:
        return None
    if tuple(t.shape) == (n, n):
        sparse = t.layout != torch.strided
        dense = t.detach().to_dense() if sparse else t.detach()
        adj = dense != 0
        if not sparse and not _graph_like(dense, adj):
            return None
    elif t.shape[0] == 2 and not t.is_floating_point() and not t.is_complex() and t.numel():
        ids = t.detach().long()
        if int(ids.min()) < 0 or int(ids.max()) >= n:
            return None
        adj = torch.zeros(n, n, dtype=torch.bool, device=t.device)
        adj[ids[0], ids[1]] = True
    else:
        return None
    eye = torch.eye(n, dtype=torch.bool, device=adj.device)
    return adj.cpu() | adj.t().cpu() | eye.cpu()


def _graph_like(dense: Tensor, adj: Tensor) -> bool:
    """A dense square tensor reads as a graph only as one: no negative weight, some pair of
    nodes not joined, and joined both ways or 0/1 (a batch of 8 samples of 8 features is
    not a graph)."""
    if dense.is_complex() or bool((dense < 0).any()):
        return False
    off = ~torch.eye(adj.shape[0], dtype=torch.bool, device=adj.device)
    if bool(adj[off].all()):
        return False
    binary = bool(((dense == 0) | (dense == 1)).all())
    return binary or bool(torch.equal(adj, adj.t()))


def _held(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The tensors a model holds that are not parameters: its buffers and plain tensor
    attributes (a fixed graph set as ``self.adj = ...`` is not always registered)."""
    found: list[tuple[str, Tensor]] = []
    for name, mod in model.named_modules():
        prefix = f"model.{name}." if name else "model."
        for key, value in vars(mod).items():
            if key == "_buffers":
                found += [(prefix + k, v) for k, v in value.items() if isinstance(v, Tensor)]
            elif isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                found.append((prefix + key, value))
    return found


def declared_graph(
    batch: Any, n: int, model: Optional[nn.Module] = None
) -> Optional[tuple[str, Tensor]]:
    """The first tensor that is a graph over the batch's ``n`` samples, as an adjacency: one
    of the batch, or one ``model`` holds (a full-graph GCN keeps its fixed adjacency as a
    buffer, the node features its only input). A held tensor must leave some pair of
    samples unjoined once made symmetric: a causal mask whose size happens to be ``n`` joins
    every pair, and says nothing about the samples."""
    eye = torch.eye(n, dtype=torch.bool)
    held = _held(model) if model is not None else []
    for path, t in _tensors(batch, "batch") + held:
        try:
            adj = _adjacency(t, n)
        except (RuntimeError, TypeError):
            continue
        if adj is None or not bool((adj & ~eye).any()):
            continue
        if path.startswith("model.") and bool((adj | eye).all()):
            continue
        return path, adj
    return None


def nodes_of_edge_batch(batch: Any) -> Optional[int]:
    """The batch size of a batch whose tensors share a leading dimension but for an
    ``edge_index`` ``(2, E)`` of node numbers below it (PyG's layout of a whole graph)."""
    ts = [t for _, t in _tensors(batch, "batch") if t.dim() > 0]
    edges = [t for t in ts if t.dim() == 2 and t.shape[0] == 2 and not t.is_floating_point()]
    sizes = {t.shape[0] for t in ts if not any(t is e for e in edges)}
    if len(sizes) != 1 or not edges:
        return None
    n = sizes.pop()
    ok = any(_adjacency(e, n) is not None for e in edges)
    return n if ok and n >= 2 else None


def layers_with_parameters(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))


def hops_needed(adj: Tensor, sample: int, reached: list[int], max_hops: int) -> Optional[int]:
    """The fewest hops from ``sample`` that cover ``reached``, or None beyond ``max_hops``."""
    want = torch.zeros(adj.shape[0], dtype=torch.bool)
    want[reached] = True
    front = torch.zeros(adj.shape[0], dtype=torch.bool)
    front[sample] = True
    for k in range(1, max(max_hops, 1) + 1):
        front = adj[front].any(dim=0) | front
        if not bool((want & ~front).any()):
            return k
    return None
