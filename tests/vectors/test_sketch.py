"""Tests for gradwatch.vectors.sketch and ParamMap.sketch/unsketch: the documented error
bound over many seeds, streaming without concatenation, linearity, reconstruction."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradwatch.vectors.parammap import ParamMap, ParamMapError
from gradwatch.vectors.sketch import error_bound, sketch, sketch_tensors, unsketch

SEEDS = range(300)


def vectors() -> dict[str, torch.Tensor]:
    """Dense, heavy-tailed, spiky and structured vectors: the bound must hold for each."""
    g = torch.Generator().manual_seed(0)
    spiky = 0.01 * torch.randn(2000, generator=g)
    spiky[[3, 500, 1999]] = torch.tensor([10.0, -10.0, 5.0])
    return {
        "gaussian": torch.randn(5000, generator=g),
        "heavy": torch.distributions.StudentT(2.0).sample((5000,)),
        "spiky": spiky,
        "ramp": torch.arange(3000, dtype=torch.float32),
        "constant": torch.ones(4096),
    }


def relative_norm_errors(x: torch.Tensor, k: int) -> torch.Tensor:
    sq = x.double().pow(2).sum()
    return torch.stack([sketch(x, k, seed=s).double().pow(2).sum() / sq - 1 for s in SEEDS])


@pytest.mark.parametrize("name", list(vectors()))
def test_norm_error_within_documented_bound_over_many_seeds(name: str) -> None:
    x = vectors()[name]
    k = 64
    errs = relative_norm_errors(x, k)
    xd = x.double()
    # The exact variance of the estimator for ideal hashing (module docstring).
    var = 2 / k * (1 - float(xd.pow(4).sum() / xd.pow(2).sum() ** 2))
    assert abs(float(errs.mean())) < 4 * math.sqrt(var / len(SEEDS)) + 1e-9  # unbiased
    assert float(errs.var()) < 1.5 * var + 1e-12
    for delta in (0.5, 0.2, 0.1):
        eps = error_bound(k, delta)
        # The bound for ||Sx||^2 and the weaker event for ||Sx||.
        assert float((errs.abs() > eps).double().mean()) <= delta
        norm_err = (errs + 1).sqrt() - 1
        assert float((norm_err.abs() > eps).double().mean()) <= delta


def test_inner_product_error_within_documented_bound() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g)
    y = 0.3 * x + torch.randn(4000, generator=g)
    k = 128
    scale = float(x.norm() * y.norm())
    errs = torch.tensor(
        [float(sketch(x, k, seed=s) @ sketch(y, k, seed=s) - x @ y) / scale for s in SEEDS]
    )
    xd, yd = x.double(), y.double()
    var = (
        float(
            (xd.pow(2).sum() * yd.pow(2).sum() + (xd @ yd) ** 2 - 2 * (xd.pow(2) * yd.pow(2)).sum())
            / k
        )
        / scale**2
    )
    assert float(errs.var()) < 1.5 * var
    assert abs(float(errs.mean())) < 4 * math.sqrt(var / len(SEEDS))
    for delta in (0.5, 0.1):
        assert float((errs.abs() > error_bound(k, delta)).double().mean()) <= delta


def test_error_shrinks_as_one_over_sqrt_k() -> None:
    x = vectors()["gaussian"]
    spread = {k: float(relative_norm_errors(x, k).std()) for k in (16, 256)}
    assert spread[256] < spread[16] / 2.5  # sqrt(16) = 4 in theory


def test_streaming_matches_the_concatenated_vector_and_chunking_does_not_matter() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(7, 5, generator=g),
        torch.randn(3, generator=g),
        torch.randn(4, 6, generator=g).t(),  # non-contiguous: read row-major like ParamMap
        torch.tensor(2.5),
        torch.randn(0, 4),
        torch.randn(300, generator=g).to(torch.bfloat16),
    ]
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    whole = sketch(flat, 32, seed=9)
    for chunk in (1, 7, 64, 1 << 16):
        streamed = sketch_tensors(tensors, 32, seed=9, chunk=chunk)
        torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    # Sketches of consecutive ranges, with their offsets, add up to the whole.
    head, tail = flat[:100], flat[100:]
    parts = sketch(head, 32, seed=9) + sketch(tail, 32, seed=9, offset=100)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_linear_seeded_and_float64_preserved() -> None:
    x, y = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    sx = sketch(x, 50, seed=3)
    assert sx.dtype == torch.float64 and sx.shape == (50,)
    torch.testing.assert_close(sketch(2 * x - y, 50, seed=3), 2 * sx - sketch(y, 50, seed=3))
    assert torch.equal(sketch(x, 50, seed=3), sx)
    assert not torch.equal(sketch(x, 50, seed=4), sx)
    # k without a common factor with the density falls back to fewer blocks, still unbiased.
    assert sketch(x, 7, seed=3).shape == (7,)


def test_unsketch_finds_large_elements_and_is_the_transpose() -> None:
    x = 0.01 * torch.randn(20_000)
    x[4242] = 100.0
    back = unsketch(sketch(x, 256, seed=5), x.numel(), seed=5)
    assert int(back.abs().argmax()) == 4242
    assert abs(float(back[4242]) - 100.0) < 5.0  # noise ~ ||rest|| / sqrt(k) ~ 0.1
    # <S x, z> == <x, S^T z> for any z: unsketch is the exact transpose.
    z = torch.randn(256, dtype=torch.float64)
    lhs = sketch(x.double(), 256, seed=5) @ z
    rhs = x.double() @ unsketch(z, x.numel(), seed=5, chunk=999)
    assert abs(float(lhs - rhs)) < 1e-8 * float(x.double().norm() * z.norm())


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="k must be a positive int"):
        sketch(torch.ones(3), 0)
    with pytest.raises(ValueError, match="1-D tensor"):
        sketch(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match=r"cannot sketch a torch\.bool tensor"):
        sketch_tensors([torch.ones(2, dtype=torch.bool)], 4)
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        sketch_tensors([torch.ones(2), [1.0]], 4)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\]"):
        error_bound(10, 0.0)


# --- ParamMap.sketch --------------------------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 10))


def test_parammap_sketch_of_tensors_equals_sketch_of_flat_vector_without_copy() -> None:
    model = mlp()
    pmap = ParamMap.from_module(model)
    in_place = pmap.sketch(None, 64, seed=1)
    torch.testing.assert_close(in_place, pmap.sketch(pmap.flatten(), 64, seed=1))
    model(torch.randn(8, 40)).square().sum().backward()
    torch.testing.assert_close(
        pmap.sketch(None, 64, seed=1, source="grad"),
        sketch(pmap.flatten("grad"), 64, seed=1),
    )
    back = pmap.unsketch(in_place, seed=1)
    assert back.shape == (pmap.numel,)
    pmap.unflatten(back)  # the reconstruction fits the model


def test_update_norm_from_sketches_before_and_after_a_step() -> None:
    # What the sketch is for: an update norm without a copy of the parameters.
    model = mlp()
    pmap = ParamMap.from_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 40)).square().mean().backward()
    before_vec, before = pmap.flatten(), pmap.sketch(None, 256, seed=2)
    opt.step()
    est = float((pmap.sketch(None, 256, seed=2) - before).norm())
    true = float((pmap.flatten() - before_vec).norm())
    assert abs(est / true - 1) < error_bound(256, 0.001)


def test_parammap_sketch_errors() -> None:
    pmap = ParamMap.from_module(mlp())
    with pytest.raises(ParamMapError, match=r"1-D vector of the map's 1540 elements"):
        pmap.sketch(torch.ones(5), 8)
    with pytest.raises(ParamMapError, match=r"missing gradients for '0\.weight'"):
        pmap.sketch(None, 8, source="grad")
    with pytest.raises(ParamMapError, match="cannot sketch: sketch size k"):
        pmap.sketch(None, -1)
    with pytest.raises(ParamMapError, match=r"call bind\(model\) first"):
        ParamMap.from_json(pmap.to_json()).sketch(None, 8)
