"""``gradient_mismatch``'s float64 copy reads the user's weights (issue 49's memory budget):
the same function and gradient as a float64 copy of the weights, the user's weights never
written, and nothing of a weight's size saved for the backward pass."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from _probe_models import Swish
from torch import Tensor, nn

import gradwatch
from gradwatch.probes import LOSS_FREE_PROBES, _direction, _widened
from gradwatch.probes._copies import Sharing, own_bytes, shared_copy, widened_bytes, widened_copy
from gradwatch.probes._direction import Direction, Draw, Uses, bases, reduce_grads
from gradwatch.probes._sandbox import Budget, fresh_copy
from gradwatch.probes._widened import Widened
from gradwatch.probes.gradient import gradient_agreement


class _Tied(nn.Module):
    """An embedding and its transpose as the output layer: one parameter, read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, ids: Tensor) -> Tensor:
        return F.linear(self.norm(self.emb(ids)), self.emb.weight)


def _cases() -> list[tuple[str, Callable[[], nn.Module], Callable[[], Any]]]:
    return [
        ("mlp", lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)),
         lambda: torch.randn(5, 4)),
        ("conv_bn", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                          nn.Flatten(), nn.Linear(4 * 36, 2)),
         lambda: torch.randn(2, 3, 8, 8)),
        ("lstm", lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True),
         lambda: torch.randn(2, 6, 4)),
        ("encoder", lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
         lambda: torch.randn(2, 5, 8)),
        ("tied", _Tied, lambda: torch.randint(0, 11, (3, 4))),
    ]  # fmt: skip


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    out = model(x.double() if x.is_floating_point() else x)
    return (out[0] if isinstance(out, tuple) else out).tanh().pow(2).sum()


@pytest.mark.parametrize("block", [None, 16], ids=["whole", "blocks"])
@pytest.mark.parametrize("name,build,batch", _cases(), ids=[c[0] for c in _cases()])
def test_the_widened_copy_is_the_float64_copy(
    name: str, build: Any, batch: Any, block: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block is not None:  # every matrix above 16 values read a block of rows at a time
        monkeypatch.setattr(_widened, "BLOCK", block)
    torch.manual_seed(0)
    model, x = build(), batch()
    wide, full = widened_copy(model), fresh_copy(model).double()
    assert all(isinstance(p, Widened) for p in wide.parameters())
    assert len(list(wide.parameters())) == len(list(model.parameters()))  # tied stays tied
    a, b = _loss(wide, x), _loss(full, x)
    assert float(a.detach()) == pytest.approx(float(b.detach()), rel=1e-14)
    ga = torch.autograd.grad(a, list(wide.parameters()))
    gb = torch.autograd.grad(b, list(full.parameters()))
    for g, h in zip(ga, gb):
        assert type(g) is Tensor and g.dtype == torch.float64
        assert torch.allclose(g, h, rtol=1e-12, atol=1e-14)


def test_the_backward_pass_saves_no_weight_of_its_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    copy = widened_copy(model)
    sizes = {p.numel() for p in model.parameters() if p.dim() == 2}
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = copy(torch.randn(2, 32, dtype=torch.float64, requires_grad=True)).sum()
    weights = [t for t in saved if t.numel() in sizes]
    assert len(weights) == 2 and all(isinstance(t, Widened) for t in weights)
    assert widened_bytes(copy) == 2 * 8 * 64 * 32  # twice its largest parameter, read
    loss.backward()  # the saved reads are read again


class _EditsItsWeight(nn.Module):
    """Clamps its own weight through ``.data`` in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.lin.weight.data.clamp_(-0.1, 0.1)
        return self.lin(x)


def test_the_users_weights_are_never_written() -> None:
    torch.manual_seed(0)
    model = _EditsItsWeight()
    before = [p.detach().clone() for p in model.parameters()]
    copy = widened_copy(model)
    params = list(copy.parameters())
    way = Direction("lin", ["w", "b"], Draw(params, seed=1), [0, 1], bases(copy, model, params))
    way.shift(0.5)
    copy(torch.randn(2, 4, dtype=torch.float64))  # writes the moved weight, clamped
    assert float(params[0].value().abs().max()) <= 0.1  # the copy's own values now
    assert params[0].base() is not None and params[0].base().dtype == torch.float64
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    with torch.no_grad():
        copy.lin.bias.add_(1.0)  # an in-place op on the copy, outside the forward
    assert torch.equal(model.lin.bias.detach(), before[1])


def test_a_move_reads_base_plus_h_v() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    copy = widened_copy(model)
    params = list(copy.parameters())
    draw = Draw(params, seed=2)
    base = bases(copy, model, params)
    assert base[0] is not None and base[0].data_ptr() == model.weight.data_ptr()  # the user's
    way = Direction("all", ["w", "b"], draw, [0, 1], base)
    way.shift(0.125)
    for i, p in enumerate(params):
        u = torch.cat([c for _s, _e, c in draw.chunks(i)]).view(p.shape).double()
        expected = base[i].double() + 0.125 * way.coef[i] * u
        assert torch.allclose(p.value(), expected, rtol=0, atol=1e-15)
    way.shift(0.0)
    assert all(torch.equal(p.value(), b.double()) for p, b in zip(params, base))


class _ReadsItsWeightAsAList(nn.Module):
    """Reads a weight with ``.tolist()``, which a :class:`Widened` cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        scale = 1.0 + 0.0 * sum(self.b.bias.detach().tolist())
        return self.b(Swish.apply(self.a(x))) * scale


def test_a_forward_the_widened_copy_cannot_run_falls_back_to_a_float64_copy() -> None:
    torch.manual_seed(0)
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))

    def ce(model: nn.Module, b: Any) -> Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    res = gradient_agreement(
        _ReadsItsWeightAsAList(), batch, ce, rtol=1e-3, budget=Budget(10.0), max_samples=8
    )
    assert res.form == "float64" and res.dtype == "float64"
    assert [r.name for r in res.mismatched()] == ["a"]  # still finds the wrong swish
    plain = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    res = gradient_agreement(plain, batch, ce, rtol=1e-3, budget=Budget(10.0), max_samples=8)
    assert res.form == "widened" and not res.mismatched()


def test_a_move_read_a_block_of_rows_at_a_time_is_the_whole_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_widened, "BLOCK", 16)  # blocks of 2 rows of 6 values
    monkeypatch.setattr(_direction, "CHUNK", 7)  # draws that straddle the blocks
    torch.manual_seed(0)
    model, ids = _Tied(), torch.randint(0, 11, (3, 4))
    wide, full = widened_copy(model), fresh_copy(model).double()
    moved = []
    for copy in (wide, full):
        params = list(copy.parameters())
        way = Direction("all", [], Draw(params, seed=4), [0, 1, 2], bases(copy, model, params))
        way.shift(0.3)
        moved.append(_loss(copy, ids))
    assert float(moved[0].detach()) == pytest.approx(float(moved[1].detach()), rel=1e-13)
    assert float(moved[0].detach()) != pytest.approx(float(_loss(model.double(), ids).detach()))


class _ReadsEveryWay(nn.Module):
    """One matrix read by a lookup, an index and a product, and one read by ``@`` and by
    an op no torch-function mode sees (:class:`Uses` cannot make a view for that read)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 5))
        self.v = nn.Parameter(torch.randn(5, 5))

    def forward(self, ids: Tensor) -> Tensor:
        h = F.embedding(ids, self.w) + self.w[ids.flip(0)]
        with torch._C.DisableTorchFunction():
            unseen = torch.mm(h.reshape(-1, 5), self.v).view_as(h)
        h = torch.tanh(h @ self.v) + unseen
        return F.linear(h, self.w)


class _TiedWithBias(_Tied):
    """BERT's decoder: the embedding's transpose and a bias of its own as the output layer,
    the lookup padded at its last row (``padding_idx=-1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=-1)
        self.bias = nn.Parameter(torch.randn(11))

    def forward(self, ids: Tensor) -> Tensor:
        return F.linear(self.norm(self.emb(ids)), self.emb.weight, self.bias)


@pytest.mark.parametrize("block", [None, 16], ids=["whole", "rows"])
@pytest.mark.parametrize("model", [_Tied, _TiedWithBias, _ReadsEveryWay])
def test_each_read_reduced_alone_adds_up_to_the_gradient(
    model: Any, block: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rows``: a matrix above 16 values read by a lookup or a linear layer is read as
    leaves of 3 rows or fewer (``_rowreads``), each gradient reduced at its offset; a draw
    chunk of 7 values straddles them."""
    if block is not None:
        monkeypatch.setattr(_widened, "BLOCK", block)
        monkeypatch.setattr(_direction, "CHUNK", 7)
    torch.manual_seed(0)
    net, ids = model(), torch.randint(0, 7, (3, 4))
    if model is _TiedWithBias:
        ids[0, 0] = 10  # its padding row
    copy = widened_copy(net)
    params = list(copy.parameters())
    uses = Uses(params)
    every = list(range(len(params)))
    Direction("all", [], Draw(params, seed=5), every, bases(copy, net, params)).shift(
        0.2
    )  # values of the copy's own: a block reads its rows alone
    with uses:
        loss = _loss(copy, ids)
    reads = uses.reads(loss)
    assert len(reads) > len(params)  # some parameter read more than once, alone each time
    draw = Draw(params, seed=3)
    reduced = reduce_grads(loss, draw, uses)
    again = _loss(copy, ids)
    assert float(again.detach()) == pytest.approx(float(loss.detach()), rel=1e-14)
    full = torch.autograd.grad(again, params)
    for i, g in enumerate(full):
        assert reduced.dots[i] == pytest.approx(draw.dot(i, g), rel=1e-12, abs=1e-14)
    if block is not None and model is not _ReadsEveryWay:  # every read of the matrix by rows
        assert sum(lo > 0 for _i, _t, lo in reads) >= 4
        assert reduced.largest <= 8 * 3 * 6  # a block's gradient at most, never 11 x 6


def test_the_shared_copy_holds_no_weight_and_never_writes_the_users() -> None:
    torch.manual_seed(0)
    model = _EditsItsWeight()
    before = [p.detach().clone() for p in model.parameters()]
    copy = shared_copy(model)
    assert all(isinstance(p, Widened) and p.dtype == torch.float32 for p in copy.parameters())
    assert own_bytes(copy) == 0  # no buffer, and every weight read from the user's
    x = torch.randn(2, 4)
    expected = F.linear(x, before[0].clamp(-0.1, 0.1), before[1])
    assert torch.equal(copy(x), expected)  # the clamp wrote the copy's own values
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    plain = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    shared = shared_copy(plain)
    assert (
        torch.equal(shared(x), plain(x)) and own_bytes(shared) == 4 * 3 + 4 * 3 + 8
    )  # its buffers


class _ListsItsWeight(nn.Module):
    """Reads its bias with ``.tolist()``, which a tensor subclass refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + 0.0 * sum(self.lin.bias.tolist())


def test_a_probe_whose_step_fails_on_the_shared_copy_runs_again_on_its_own() -> None:
    torch.manual_seed(0)
    config = {"checks": {c: {"enabled": c == "sample_dependence"} for c in LOSS_FREE_PROBES}}
    report = gradwatch.probe(
        _ListsItsWeight(), (torch.randn(6, 4),), lambda m, b: m(b[0]).sum(), config=config
    )
    record = {r.id: r for r in report.probes}["sample_dependence"]
    assert record.verdict == "passed"  # judged, on a plain copy
    with Sharing(enabled=False):
        assert not any(isinstance(p, Widened) for p in shared_copy(_ListsItsWeight()).parameters())


def test_a_view_made_of_fresh_values_is_never_the_users_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    copy = shared_copy(model)
    monkeypatch.setattr(_widened, "_view", lambda *a: None)  # a view the meta run cannot make
    with torch.no_grad():
        flat = copy.weight.view(-1)
        assert type(flat) is Tensor and torch.equal(flat, before.view(-1))
        flat.zero_()
    assert torch.equal(model.weight.detach(), before)
