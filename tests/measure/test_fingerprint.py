"""Copy-free change detection (gradwatch/core/sketch.py): exact "did it change", estimate vs exact norm."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.measure import carry
from gradwatch.measure import fingerprint as sketch


def _shapes() -> list[tuple[int, ...]]:
    # small tensors flattened in groups, and large ones sampled by stride
    return [(16, 16), (16,), (3,), (300, 400), (1 << 17,), (64, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_one_element_change_is_never_missed(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g).to(dtype) for s in _shapes()]
    for k, t in enumerate(ts):
        flat = t.view(-1)
        for pos in (0, flat.numel() // 2 + 1, flat.numel() - 1):
            carry.forget()  # fresh reads (a carried checksum: tests/measure/test_carry.py)
            fp = sketch.fingerprint(ts)
            old = flat[pos].clone()
            flat[pos] = torch.nextafter(old.float(), torch.tensor(math.inf)).to(dtype)
            if flat[pos] == old:  # the next float32 rounds back in a 16-bit dtype
                flat[pos] = old * 1.01 + 1e-3
            changed, delta = sketch.compare(ts, fp)
            assert changed.tolist() == [float(j == k) for j in range(len(ts))], (k, pos)
            assert delta[k] > 0 and (delta[torch.arange(len(ts)) != k] == 0).all()


def test_nothing_changed_is_exactly_zero() -> None:
    ts = [torch.randn(s) for s in _shapes()]
    fp = sketch.fingerprint(ts)
    m = sketch.measure(ts, fp)
    assert m.changed is not None and m.delta is not None
    assert m.changed.tolist() == [0.0] * len(ts) and m.delta.tolist() == [0.0] * len(ts)
    exact = [float(torch.linalg.vector_norm(t)) for t in ts]
    assert m.param_norm.tolist() == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize("kind", ["dense", "rank1", "constant", "weight_decay", "rows", "columns"])
def test_update_norm_estimate_against_the_exact_value(kind: str) -> None:
    """The estimate's relative error stays inside the documented bound on many updates."""
    g = torch.Generator().manual_seed(1)
    errors = []
    for trial in range(12):
        ts = [torch.randn(s, generator=g) for s in _shapes()]
        before = [t.clone() for t in ts]  # the test's exact reference, not gradwatch's
        fp = sketch.fingerprint(ts)
        for t in ts:
            m = t if t.dim() == 2 else t.view(1, -1)
            if kind == "dense":
                m.add_(1e-4 * torch.randn(m.shape, generator=g))
            elif kind == "rank1":
                u = torch.randn(m.shape[0], 1, generator=g)
                v = torch.randn(1, m.shape[1], generator=g)
                m.add_(1e-5 * u * v)
            elif kind == "constant":
                m.add_(1e-6)
            elif kind == "weight_decay":
                m.mul_(1 - 1e-5)
            elif kind == "rows":  # an embedding: a quarter of the rows move
                rows = m[: max(1, m.shape[0] // 4)]
                rows.add_(1e-3 * torch.randn(rows.shape, generator=g))
            else:  # dead input features: half of the columns move
                cols = m[:, : max(1, m.shape[1] // 2)]
                cols.add_(1e-3 * torch.randn(cols.shape, generator=g))
        changed, delta = sketch.compare(ts, fp)
        assert changed.tolist() == [1.0] * len(ts)
        for t, b, d in zip(ts, before, delta.tolist()):
            exact = float(torch.linalg.vector_norm(t.double() - b.double()))
            if t.numel() > sketch.MIN_SAMPLES:
                errors.append(abs(d - exact) / exact)
            else:  # every element is sampled: exact up to float32 rounding
                assert d == pytest.approx(exact, rel=1e-3), trial
    errors.sort()
    # Documented: ~sqrt(2/m)/2 relative error on the norm for spread-out updates (m >= 64
    # samples: ~9 %); sparse updates (a quarter of the rows) are worse.
    median, p95 = errors[len(errors) // 2], errors[int(0.95 * len(errors))]
    sparse = kind in ("rows", "columns")
    assert median < (0.2 if sparse else 0.1), (kind, median)
    assert p95 < (0.6 if sparse else 0.3), (kind, p95)


def test_memory_is_a_small_fraction_of_the_parameters() -> None:
    ts = [torch.zeros(1024, 1024) for _ in range(4)] + [torch.zeros(1024) for _ in range(4)]
    fp = sketch.fingerprint(ts)
    param_bytes = sum(t.numel() * t.element_size() for t in ts)
    assert sketch.nbytes(fp) / param_bytes < 0.01


def test_non_contiguous_large_tensor_has_no_estimate_but_a_norm() -> None:
    t = torch.randn(400, 300).t()  # large and non-contiguous
    fp = sketch.fingerprint([t])
    t.add_(1.0)
    m = sketch.measure([t], fp)
    assert m.delta is not None and math.isnan(float(m.delta[0]))
    assert float(m.param_norm[0]) == pytest.approx(float(torch.linalg.vector_norm(t)), rel=1e-5)


def test_measure_refuses_another_list() -> None:
    a, b = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="fingerprinted"):
        sketch.measure([b], sketch.fingerprint([a]))


def test_the_moved_share_is_exact_and_a_fingerprint_is_measured_once() -> None:
    """The large tensors' samples take their differences in place (measure/_big.py): the
    share of sampled values that moved is exact, NaN counts as moved, and a second measure
    of the same fingerprint, which would read differences as samples, is refused."""
    carry.forget()
    ts = [torch.randn(1 << 17), torch.randn(300, 400), torch.randn(200, 500)]
    fp = sketch.fingerprint(ts)
    big = {b.position: b for b in fp.plan.big}
    assert set(big) == {0, 1, 2}, "every tensor here is sampled by stride"
    ts[0].add_(1.0)  # every value moves
    ts[1][:, :100].add_(1.0)  # a quarter of the columns
    ts[2].view(-1)[big[2].offset] = float("nan")  # one sampled value
    m = sketch.measure(ts, fp)
    assert m.changed is not None and m.moved_frac is not None and m.delta is not None
    b = big[1]
    idx = torch.arange(b.m) * b.stride + b.offset
    want = float(((idx % 400) < 100).double().mean())
    assert m.moved_frac.tolist() == pytest.approx([1.0, want, 1 / big[2].m], rel=1e-6)
    assert m.changed.tolist() == [1.0, 1.0, 1.0]
    assert float(m.delta[0]) == pytest.approx(math.sqrt(ts[0].numel()), rel=1e-6)
    assert math.isnan(float(m.delta[2]))
    with pytest.raises(ValueError, match="once"):
        sketch.measure(ts, fp)
