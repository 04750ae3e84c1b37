"""``gradient_mismatch`` holds its float64 copy and nothing of the model's size beside it
(issue 49): directions drawn again a chunk at a time, the gradient reduced as autograd makes
it, and the user's weights as the base."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _probe_models import Swish, mlp
from torch import Tensor, nn

import gradwatch
from gradwatch.probes import _direction
from gradwatch.probes._direction import Direction, Draw, bases, joint, reduce_grads
from gradwatch.probes._masks import EmbeddingMasks
from gradwatch.probes._sandbox import fresh_copy


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_direction, "CHUNK", 7)  # every tensor below spans several chunks


def _whole(draw: Draw, i: int) -> Tensor:
    return torch.cat([u for _s, _e, u in draw.chunks(i)]).view(draw.params[i].shape)


def _params() -> list[Tensor]:
    torch.manual_seed(0)
    strided = nn.Parameter(torch.randn(6, 5, dtype=torch.float64)).t()  # not contiguous
    return [
        nn.Parameter(torch.randn(4, 6, dtype=torch.float64)),
        strided,
        nn.Parameter(torch.randn(3, dtype=torch.float64)),
    ]


def test_a_draw_is_the_same_at_each_use_and_zero_on_masked_rows() -> None:
    params = _params()
    masks = EmbeddingMasks({id(params[0]): 0})
    masks.rows[id(params[0])] = {1, 3}
    draw = Draw(params, seed=5, masks=masks)
    first = [_whole(draw, i) for i in range(3)]
    assert all(torch.equal(a, _whole(draw, i)) for i, a in enumerate(first))
    assert first[0][[1, 3]].abs().sum() == 0 and first[0][[0, 2]].abs().sum() > 0
    assert draw.norm_sq(0) == pytest.approx(float(first[0].double().pow(2).sum()))
    assert not torch.equal(first[2], _whole(Draw(params, seed=6), 2))


def test_a_move_is_base_plus_h_v_and_the_way_back_is_exact() -> None:
    params = _params()
    base = [p.detach().clone() for p in params]
    draw = Draw(params, seed=1)
    way = Direction("all", ["a", "b", "c"], draw, [0, 1, 2], base)
    way.shift(0.25)
    for i, p in enumerate(params):
        expected = base[i] + 0.25 * way.coef[i] * _whole(draw, i).double()
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-15)
    way.shift(0.0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, base))
    v = [way.coef[i] * _whole(draw, i).double() for i in range(3)]
    assert sum(float(t.pow(2).sum()) for t in v) == pytest.approx(1.0)  # a unit direction


def test_the_reduced_gradient_is_the_full_gradient_along_the_draw() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(9, 4, sparse=True).double()
    lin = nn.Linear(4, 3).double()
    unused = nn.Parameter(torch.randn(2, dtype=torch.float64))
    params = [emb.weight, lin.weight, lin.bias, unused]
    ids = torch.tensor([[1, 2, 2], [0, 5, 8]])

    def loss() -> Tensor:
        return lin(emb(ids)).tanh().sum()

    full = torch.autograd.grad(loss(), params, allow_unused=True)
    draw = Draw(params, seed=3)
    reduced = reduce_grads(loss(), draw)
    for i, g in enumerate(full[:3]):
        dense = g.to_dense()
        u = _whole(draw, i).double()
        assert reduced.dots[i] == pytest.approx(float((dense * u).sum()), rel=1e-12)
        assert reduced.sq[i] == pytest.approx(float(dense.pow(2).sum()), rel=1e-12)
    assert reduced.dots[3] is None and full[3] is None  # the loss does not reach it
    way = Direction("lin", ["w", "b"], draw, [1, 2], [p.detach().clone() for p in params])
    assert way.directional(reduced) == pytest.approx(way.directional_of(list(full)))


def test_the_joint_direction_weighs_each_layer_by_its_gradient() -> None:
    params = _params()
    draw = Draw(params, seed=2)
    reduced = _direction.Reduced(3)
    reduced.sq = [100.0, 0.0, 1.0]  # layer 0's gradient is 10 x layer 1's
    whole = joint(draw, [[0, 1], [2]], reduced, [p.detach() for p in params], ["a", "b", "c"])
    assert whole.coef[0] == whole.coef[1] and whole.coef[2] == pytest.approx(10 * whole.coef[0])


def test_the_base_is_the_users_own_weight_where_the_copy_holds_its_values() -> None:
    model = mlp()
    copy = fresh_copy(model).double()
    params = list(copy.parameters())
    with torch.no_grad():
        params[-1].add_(1.0)  # changed on the copy: its base is its own value, saved
    found = bases(copy, model, params)
    originals = list(model.parameters())
    assert all(b.data_ptr() == o.data_ptr() for b, o in zip(found[:-1], originals[:-1]))
    assert found[-1].data_ptr() != originals[-1].data_ptr()
    assert torch.equal(found[-1].double(), params[-1].detach())


class _WrongSwish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(Swish.apply(self.a(x)))


def _watched(model: nn.Module) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
        with gradwatch.watch(model, opt, config={"preview": True}) as w:
            for _ in range(3):
                x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    return w.report()


def test_watch_still_finds_a_wrong_derivative_and_passes_a_correct_model() -> None:
    torch.manual_seed(0)
    record = {p.id: p for p in _watched(_WrongSwish()).probes}["gradient_mismatch"]
    assert record.verdict == "finding" and record.details["dtype"] == "float64"
    torch.manual_seed(0)
    clean = {p.id: p for p in _watched(mlp(d=6, out=3)).probes}["gradient_mismatch"]
    assert clean.verdict == "passed", clean.note
