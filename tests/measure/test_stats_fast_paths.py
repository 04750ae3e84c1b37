"""The fast paths of statistics steps give what the general code gives (issue 17)."""

from __future__ import annotations

import math
import random
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwatch.checks._window import MedianWindow
from gradwatch.core.layers import folded_samples
from gradwatch.measure.chunked import ABS_CHUNK, CHUNK, abs_stats, norms_and_checksums
from gradwatch.measure.columns import fold, layout
from gradwatch.measure.stats import foreach_norms, median, to_host


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=80),
    st.integers(min_value=1, max_value=12),
)
def test_median_window_matches_sorting_the_last_values(values: list[float], maxlen: int) -> None:
    w = MedianWindow(maxlen)
    for k, v in enumerate(values):
        w.append(v)
        kept = values[max(0, k + 1 - maxlen) : k + 1]
        assert len(w) == len(kept)
        assert w.median() == median(kept)
    # push: the window's count, median and largest before the value, then the value joins
    p = MedianWindow(maxlen)
    for k, v in enumerate(values):
        kept = values[max(0, k - maxlen) : k]
        expected = (len(kept), median(kept), max(kept)) if kept else (0, 0.0, 0.0)
        assert p.push(v) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_abs_stats_match_the_separate_kernels(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # one tensor over several chunks (with a short last chunk), one below a chunk
    ts = [
        torch.randn(2 * ABS_CHUNK + 123, generator=g, dtype=dtype),
        torch.randn(5000, dtype=dtype),
    ]
    ts[0][ABS_CHUNK - 3 : ABS_CHUNK + 40] = 0.0  # zeros across a chunk boundary
    ts[0][ABS_CHUNK + 77] = -1e30 if dtype is torch.float64 else -3e30  # the max, negative
    ts[1][:50] = -0.0  # a zero with its sign bit set is a zero (the count reads bit patterns)
    ts[1][60] = 1e-45 if dtype is torch.float32 else 5e-324  # the smallest subnormal is not
    l1, mx, nnz, l2 = abs_stats(ts)  # type: ignore[misc]
    for k, t in enumerate(ts):
        assert float(l1[k]) == pytest.approx(float(t.double().abs().sum()), rel=1e-5)
        # the float32 kernel it replaces: 3e30's square overflows in both (see the next test)
        assert float(l2[k]) == pytest.approx(float(foreach_norms([t], 2.0)[0]), rel=1e-5)
        assert float(mx[k]) == float(t.abs().max().float())  # results are float32
        assert float(nnz[k]) == float(torch.count_nonzero(t))


def test_abs_stats_propagate_nan_and_inf_and_decline_what_they_do_not_cover() -> None:
    a, b = torch.ones(ABS_CHUNK + 10), torch.ones(100)
    a[ABS_CHUNK + 5], b[3] = float("nan"), float("inf")
    l1, mx, nnz, l2 = abs_stats([a, b])  # type: ignore[misc]
    assert math.isnan(float(l1[0])) and math.isnan(float(mx[0])) and math.isnan(float(l2[0]))
    assert math.isinf(float(l2[1]))
    assert float(nnz[0]) == ABS_CHUNK + 10  # a NaN counts as non-zero, as before
    assert math.isinf(float(l1[1])) and math.isinf(float(mx[1])) and float(nnz[1]) == 100
    old = foreach_norms([a, b], 0.0)
    assert [float(v) for v in old] == nnz.tolist()
    assert abs_stats([torch.ones(3, dtype=torch.float16)]) is None
    assert abs_stats([torch.ones(3), torch.ones(3, dtype=torch.float64)]) is None
    assert abs_stats([torch.ones(3).to_sparse()]) is None
    assert abs_stats([]) is None
    # CPU tensors only (the host sync test exempts this module on that ground)
    assert abs_stats([torch.ones(3, device="meta")]) is None


def test_abs_stats_count_the_zeros_beside_a_nan() -> None:
    # a NaN makes the chunk's min NaN: the zeros beside it must still be counted
    c = torch.ones(ABS_CHUNK + 100)
    c[7], c[8:20] = float("nan"), 0.0
    c[ABS_CHUNK + 1 : ABS_CHUNK + 4] = -0.0
    nnz = abs_stats([c])[2]  # type: ignore[index]
    assert float(nnz[0]) == ABS_CHUNK + 100 - 12 - 3


def _generic(stats, arrived, gn, numel, groups):  # type: ignore[no-untyped-def]
    """The slow path's arithmetic (core/gather.py layer_samples), for comparison."""
    out = {}
    for layer, js in groups.items():
        live = [j for j in js if arrived[j] and gn[j] is not None]
        size = sum(numel[j] for j in live) or 1
        dn = [stats["delta"][j] for j in js if stats["delta"][j] is not None]
        out[layer] = (
            math.hypot(*[gn[j] for j in live]),
            sum(stats["l1"][j] for j in live) / size,
            max(stats["linf"][j] for j in live),
            sum(stats["nnz"][j] for j in live),
            size,
            math.hypot(*[stats["param_norm"][j] for j in js]),
            math.hypot(*dn) if len(dn) == len(js) else None,
        )
    return out


@pytest.mark.parametrize("delta_kind", ["all", "none", "one_unknown"])
def test_folded_columns_equal_the_general_path(delta_kind: str) -> None:
    rnd = random.Random(1)
    n = 31
    groups: dict[str, list[int]] = {}
    for j in range(n):  # layers of one, two and three parameters, interleaved
        groups.setdefault(f"l{j % 11}", []).append(j)
    vals = {k: [rnd.uniform(0.0, 3.0) for _ in range(n)] for k in ("l1", "linf", "pn")}
    nnz = [float(rnd.randint(0, 300)) for _ in range(n)]
    delta: list[Optional[float]] = [rnd.uniform(0, 1) for _ in range(n)]
    if delta_kind == "none":
        delta = [None] * n
    elif delta_kind == "one_unknown":
        delta[7] = None  # layer l7: its update unknown; the other layers keep theirs
    stats = {"l1": vals["l1"], "linf": vals["linf"], "nnz": nnz, "param_norm": vals["pn"]}
    stats["delta"] = delta  # type: ignore[assignment]
    gn = [rnd.uniform(0.0, 5.0) for _ in range(n)]
    numel = [rnd.randint(1, 300) for _ in range(n)]
    t = lambda xs: torch.tensor([float("nan") if x is None else x for x in xs])  # noqa: E731
    lay = layout(groups)
    d = None if delta_kind == "none" else t(delta)
    folded = fold(lay, t(gn), t(vals["l1"]), t(vals["linf"]), t(nnz), t(vals["pn"]), d)
    got = folded_samples(to_host([folded]), lay, numel)
    want = _generic(stats, [True] * n, gn, numel, groups)
    assert list(got) == list(want)
    for layer, s in got.items():
        row = (s.norm, s.mean_abs, s.max_abs, s.nonzero, s.numel, s.param_norm, s.delta_norm)
        for x, y in zip(row, want[layer]):
            assert (x is None and y is None) or x == pytest.approx(y, rel=1e-6)
        assert s.positions == groups[layer]
    assert (got["l7"].delta_norm is None) == (delta_kind != "all")
    assert (got["l8"].delta_norm is None) == (delta_kind == "none")


def test_folded_norms_keep_float32_overflow_out_of_a_layer() -> None:
    """Squares in float64: two norms of 1e20 make a layer norm of 1.41e20, not inf."""
    lay = layout({"a": [0, 1]})
    v = torch.tensor([1e20, 1e20])
    got = folded_samples(to_host([fold(lay, v, v, v, v, v, v)]), lay, [4, 4])["a"]
    assert got.norm == pytest.approx(2**0.5 * 1e20, rel=1e-6)
    assert got.param_norm == pytest.approx(2**0.5 * 1e20, rel=1e-6)


def test_stacked_stats_equal_the_flattened_segments() -> None:
    from gradwatch.measure.chunked import stacked_stats
    from gradwatch.measure.stats import flatten_cpu, segment_norms

    g = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(16, 16, generator=g) if k % 2 == 0 else torch.randn(16, generator=g)
        for k in range(40)
    ]
    ts[4].zero_()
    ts[7][3] = float("nan")
    ts[9][0] = float("inf")
    ords = (2.0, 1.0, math.inf, 0.0)
    got = stacked_stats(ts, ords)
    assert got is not None
    flat = flatten_cpu(ts)
    assert flat is not None
    for a, b in zip(got, segment_norms(flat, ts, ords)):
        assert isinstance(b, torch.Tensor)
        assert torch.allclose(a, b, rtol=1e-6, equal_nan=True)
    unique = [torch.randn(k + 1) for k in range(8)]  # every shape once: not worth stacking
    assert stacked_stats(unique, ords) is None


def test_stacked_non_zero_counts_are_count_nonzero_at_the_edges() -> None:
    """The stacked count reads |x|'s bit pattern: -0.0 is zero, NaN, Inf and the smallest
    subnormal are not (as ``count_nonzero``), in float32, float64 and bfloat16 rows."""
    from gradwatch.measure.chunked import stacked_stats

    edge = [float("nan"), float("inf"), -0.0, 0.0, 1e-45, -3.0, float("-inf"), 0.0]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ts = [torch.tensor(edge, dtype=dtype).roll(k) for k in range(6)]
        ts[2] = torch.zeros(8, dtype=dtype)
        got = stacked_stats(ts, (0.0,))
        assert got is not None
        want = [float(torch.count_nonzero(t.float())) for t in ts]
        assert got[0].tolist() == want, dtype


def test_stacked_fingerprints_see_one_changed_element_of_many_same_shape_tensors() -> None:
    from gradwatch.measure.fingerprint import fingerprint, measure

    g = torch.Generator().manual_seed(4)
    ts = [
        torch.randn(16, 16, generator=g) if k % 2 == 0 else torch.randn(16, generator=g)
        for k in range(60)
    ]
    before = fingerprint(ts)
    ts[33][5] += 1e-6  # one element of one bias, a tiny change
    ts[10][15, 15] = 0.25
    m = measure(ts, before)
    assert m.changed is not None and m.delta is not None
    changed = [k for k, v in enumerate(m.changed.tolist()) if v]
    assert changed == [10, 33]
    exact = torch.stack([t.norm() for t in ts])
    assert torch.allclose(m.param_norm, exact, rtol=1e-6)
    assert all(v == 0.0 for k, v in enumerate(m.delta.tolist()) if k not in (10, 33))


def test_stacked_norms_with_a_stale_layout_key_stay_right() -> None:
    """The caller's layout key skips reading shapes; a key whose shapes changed is dropped."""
    from gradwatch.measure.chunked import stacked_stats

    def truth(ts: list[torch.Tensor]) -> list[float]:
        return [float(t.double().norm()) for t in ts]

    layout = object()
    first = [torch.randn(4, 4) if k % 2 else torch.randn(4) for k in range(12)]
    got = stacked_stats(first, (2.0,), id(layout))
    assert got is not None and got[0].tolist() == pytest.approx(truth(first), rel=1e-6)
    # same shapes in another grouping that still holds (each group one shape): same values
    swapped = [torch.randn(4) if k % 2 else torch.randn(4, 4) for k in range(12)]
    got = stacked_stats(swapped, (2.0,), id(layout))
    assert got is not None and got[0].tolist() == pytest.approx(truth(swapped), rel=1e-6)
    # shapes moved across the stale groups: a group mixes shapes -> declined, key dropped
    moved = [torch.randn(4) for _ in range(6)] + [torch.randn(4, 4) for _ in range(6)]
    assert stacked_stats(moved, (2.0,), id(layout)) is None
    again = stacked_stats(moved, (2.0,), id(layout))  # regrouped from the shapes
    assert again is not None and again[0].tolist() == pytest.approx(truth(moved), rel=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1.0, 1e25])
def test_fused_l2_norms_agree_with_the_kernel_they_replace_at_every_scale(scale: float) -> None:
    """Vanishing (1e-30) to exploding (1e25) values: the chunked float32 squares give what
    ``_foreach_norm`` gave (the same overflow to Inf, the same underflow), and the exact norm
    wherever float32 holds the squares."""
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(ABS_CHUNK + 500, generator=g) * scale, torch.zeros(4000)]
    _, _, _, l2 = abs_stats(ts)  # type: ignore[misc]
    old = [float(v) for v in foreach_norms(ts, 2.0)]
    assert float(l2[1]) == old[1] == 0.0
    assert float(l2[0]) == pytest.approx(old[0], rel=1e-5)
    if 1e-15 < scale < 1e15:
        assert float(l2[0]) == pytest.approx(float(ts[0].double().norm()), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_and_checksums_match_the_fingerprint_and_the_norm(dtype: torch.dtype) -> None:
    """One read gives both: the norm, and a checksum equal to the whole tensor's wrapping sum
    of bit patterns (what ``fingerprint`` took before the step), over several chunks."""
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(3 * CHUNK + 7, generator=g, dtype=dtype), torch.randn(999, dtype=dtype)]
    n, c, s = norms_and_checksums(ts)  # type: ignore[misc]
    assert s == []  # no samples asked for
    wide = torch.int32 if dtype is torch.float32 else torch.int64
    for k, t in enumerate(ts):
        assert float(n[k]) == pytest.approx(float(t.double().norm()), rel=1e-5)
        assert int(c[k]) == int(t.view(wide).sum(dtype=wide))
    ts[0][CHUNK + 1] += 1.0
    assert int(norms_and_checksums(ts)[1][0]) != int(c[0])  # type: ignore[index]
    assert norms_and_checksums([torch.ones(3, dtype=torch.bfloat16)]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_samples_taken_in_the_pass_are_the_strided_samples(dtype: torch.dtype) -> None:
    """The samples picked chunk by chunk are the strided sample of the whole tensor, as
    float32 copies, wherever the strides cross chunk boundaries."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(3 * CHUNK + 7, generator=g, dtype=dtype) for _ in range(4)]
    keys = [
        (0, 1, 3 * CHUNK + 7),
        (5, 509, (3 * CHUNK + 2) // 509 + 1),
        (CHUNK - 1, 2, 3),
        (7, CHUNK + 3, 3),
    ]
    _, _, taken = norms_and_checksums(ts, keys)  # type: ignore[misc]
    for t, (offset, stride, count), s in zip(ts, keys, taken):
        want = t[offset : offset + (count - 1) * stride + 1 : stride].to(torch.float32)
        assert s.dtype is torch.float32 and len(s) == count and torch.equal(s, want)
        assert s.data_ptr() != t.data_ptr()  # a copy: a later step must not change it
