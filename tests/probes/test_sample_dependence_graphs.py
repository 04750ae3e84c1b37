"""``sample_dependence`` on a full-graph GCN, whose nodes are the batch: the adjacency couples
them by design (not judged, said so), while a softmax or a mean over the nodes is still
caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "sample_dependence"
CFG = only(CHECK)
N = 24


def ring_with_chords(n: int = N) -> Tensor:
    """A sparse, connected graph: a ring and a few chords (diameter well above 2)."""
    edges = [(i, (i + 1) % n) for i in range(n)] + [(0, n // 2), (3, 9)]
    a = torch.zeros(n, n)
    for i, j in edges:
        a[i, j] = a[j, i] = 1.0
    return a


def normalised(a: Tensor) -> Tensor:
    """Kipf & Welling's renormalisation, D^-1/2 (A + I) D^-1/2."""
    a = a + torch.eye(a.shape[0])
    d = a.sum(1).rsqrt()
    return d[:, None] * a * d[None, :]


class GCN(nn.Module):
    """Two graph convolutions over the whole graph (Kipf & Welling, 2017)."""

    def __init__(self, readout: Any = None) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.readout = readout or (lambda h: h)

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        h = F.relu(torch.sparse.mm(adj, self.l1(x)) if adj.is_sparse else adj @ self.l1(x))
        h = F.dropout(h, 0.5, self.training)
        out = torch.sparse.mm(adj, self.l2(h)) if adj.is_sparse else adj @ self.l2(h)
        return self.readout(out)


class EdgeIndexGCN(nn.Module):
    """The same with PyG's ``edge_index`` (2, E), message passing by ``index_add``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def _prop(self, h: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index
        deg = torch.bincount(dst, minlength=h.shape[0]).clamp_min(1).to(h.dtype)
        return h + torch.zeros_like(h).index_add(0, dst, h[src]) / deg[:, None]

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.l2(self._prop(F.relu(self.l1(self._prop(x, edge_index))), edge_index))


def graph(kind: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    train = torch.arange(N) % 3 != 0
    a = ring_with_chords()
    if kind == "edge_index":
        return x, a.nonzero().t().contiguous(), y, train
    adj = normalised(a)
    return x, (adj.to_sparse() if kind == "sparse" else adj), y, train


def node_ce(m: Any, b: Any) -> Tensor:
    x, adj, y, train = b
    return F.cross_entropy(m(x, adj)[train], y[train])


def _probe(model: nn.Module, batch: Any) -> gradwatch.Report:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    return gradwatch.probe(model, batch, node_ce, opt, config=CFG)


@pytest.mark.parametrize("kind", ["dense", "sparse", "edge_index"])
def test_a_full_graph_gcn_is_not_judged_and_says_why(kind: str) -> None:
    torch.manual_seed(0)
    model = EdgeIndexGCN() if kind == "edge_index" else GCN()
    report = _probe(model, graph(kind))
    assert not [f for f in report.findings if f.severity in ("warning", "error")]
    assert verdicts(report) == {CHECK: "not_observed"}
    (record,) = report.probes
    assert record.details["reason"] == "graph_batch" and "hop" in record.note
    (note,) = findings(report, "not_observed")
    assert note.severity == "info" and note.details["reason"] == "probe_graph_batch"


def _softmax_over_nodes(h: Tensor) -> Tensor:
    return torch.log_softmax(h, dim=0)  # over the nodes, not the classes


def _centred_over_nodes(h: Tensor) -> Tensor:
    return h - h.mean(0, keepdim=True)  # a hand-written normaliser, no BatchNorm


@pytest.mark.parametrize("readout", [_softmax_over_nodes, _centred_over_nodes])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_gcn_that_mixes_all_nodes_beyond_its_edges_is_still_an_error(
    readout: Any, kind: str
) -> None:
    torch.manual_seed(0)
    report = _probe(GCN(readout), graph(kind))
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and len(found.details["other_samples"]) == N - 1
    assert verdicts(report) == {CHECK: "finding"}


class PairScorer(nn.Module):
    """SimCLR-style scores against an (N, N) positives matrix in the batch, normalised over
    dim 0 (the batch) by mistake: the pairs are a graph, but a softmax over the batch
    reaches samples no pair connects."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: Tensor, pairs: Tensor) -> Tensor:
        z = self.f(x)
        return torch.softmax(z, dim=0) + pairs @ z


def test_a_pairwise_matrix_in_the_batch_does_not_hide_a_softmax_over_the_batch() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    batch = (x, torch.eye(N).roll(1, 0), y)
    report = gradwatch.probe(
        PairScorer(), batch, lambda m, b: F.cross_entropy(m(b[0], b[1]), b[2]), config=CFG
    )
    (found,) = findings(report, CHECK)
    assert found.severity == "error"


def test_a_square_batch_of_features_is_not_read_as_a_graph() -> None:
    """8 samples of 8 features (a Gaussian matrix, (N, N) by chance) hold no graph: a
    softmax over the batch stays an error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Softmax(dim=0), nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen))
    report = gradwatch.probe(model, batch, lambda m, b: F.mse_loss(m(b[0]), b[1]), config=CFG)
    (found,) = findings(report, CHECK)
    assert found.severity == "error"


class HeldGraphGCN(GCN):
    """The same GCN with its fixed graph kept on the model (``register_buffer`` or a plain
    attribute), the node features its only input: the layout of the PyG/DGL tutorials'
    full-graph training and of Kipf & Welling's reference code."""

    def __init__(self, adj: Tensor, how: str, readout: Any = None) -> None:
        super().__init__(readout)
        if how == "buffer":
            self.register_buffer("adj", adj)
        else:
            self.adj = adj

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x, self.adj)


def _held(kind: str, how: str, readout: Any = None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    x, adj, y, train = graph(kind)
    return HeldGraphGCN(adj, how, readout), (x, y, train)


def held_ce(m: Any, b: Any) -> Tensor:
    x, y, train = b
    return F.cross_entropy(m(x)[train], y[train])


@pytest.mark.parametrize("how", ["buffer", "attribute"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_graph_the_model_holds_is_declared_too(kind: str, how: str) -> None:
    model, batch = _held(kind, how)
    cfg = only(CHECK)
    cfg["checks"]["batch_order_dependent"] = {"enabled": True}
    report = gradwatch.probe(model, batch, held_ce, config=cfg)
    assert not [f for f in report.findings if f.severity in ("warning", "error")]
    records = {p.id: p for p in report.probes}
    for probe_id in (CHECK, "batch_order_dependent"):
        assert records[probe_id].details["reason"] == "graph_batch"
        assert "model.adj declares a graph" in records[probe_id].note


def test_watch_with_the_graph_on_the_model_runs_clean() -> None:
    model, (x, y, train) = _held("sparse", "buffer")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    with gradwatch.watch(model, opt) as w:  # the loss-free probes run on the first batch
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x)[train], y[train]).backward()
            opt.step()
    report = w.report()
    assert not [f.line() for f in report.findings if f.severity in ("warning", "error")]
    assert {p.id: p.verdict for p in report.probes}["forward_not_reproducible"] == "passed"


def test_a_held_graph_does_not_hide_a_softmax_over_the_nodes() -> None:
    model, batch = _held("dense", "buffer", _softmax_over_nodes)
    report = gradwatch.probe(model, batch, held_ce, config=CFG)
    (found,) = findings(report, CHECK)
    assert found.severity == "error"


class MaskedMixer(nn.Module):
    """A causal mask buffer whose size happens to equal the batch's, and a mean over the
    batch by mistake: a mask joining every pair once symmetric declares no graph."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(n, n)))
        self.f = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        z = self.f(x)
        return z - z.mean(0, keepdim=True)


def test_a_mask_buffer_of_the_batch_size_is_not_a_graph() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=gen), torch.randint(0, 3, (N,), generator=gen)
    report = gradwatch.probe(
        MaskedMixer(N), (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), config=CFG
    )
    (found,) = findings(report, CHECK)
    assert found.severity == "error"
