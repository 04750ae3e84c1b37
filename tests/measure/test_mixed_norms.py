"""A list of small tensors beside large ones (biases and norms beside matrices): the small
ones take the stacked or flattened path together, the large ones the chunked pass, and the
values are those of one tensor at a time."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.measure import stats
from gradwatch.measure.stats import norms

ORDS = (2.0, 1.0, math.inf, 0.0)


def _mixed(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for _ in range(6):  # a transformer block's shapes, scaled down
        out += [torch.randn(64, generator=g), torch.randn(64, generator=g)]
        out += [torch.randn(64, 192, generator=g), torch.randn(192, generator=g)]
        out += [torch.randn(9000, generator=g)]  # just above the small path's limit
    out[0].zero_()
    out[1][3] = float("nan")
    out[3][5] = float("inf")
    out[2][0, :7] = 0.0
    return out


def _one_at_a_time(ts: list[torch.Tensor], o: float) -> torch.Tensor:
    if o == 0.0:
        return torch.tensor([float(torch.count_nonzero(t)) for t in ts])
    return torch.stack(
        [torch.linalg.vector_norm(t if t.is_complex() else t.double(), o).float() for t in ts]
    )


def _vector(chunk: object) -> torch.Tensor:
    return chunk if isinstance(chunk, torch.Tensor) else torch.stack(chunk)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [None, "params"])
def test_a_mixed_list_gives_each_tensors_own_statistics(
    layout: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    ts = _mixed()
    seen: list[int] = []
    chunked = stats.abs_stats

    def spy(tensors: list[torch.Tensor]) -> object:
        seen.extend(t.numel() for t in tensors)
        return chunked(tensors)

    monkeypatch.setattr(stats, "abs_stats", spy)
    got = norms(ts, ORDS, layout)
    for o, v in zip(ORDS, got):
        want = _one_at_a_time(ts, o)
        assert torch.allclose(_vector(v), want, rtol=1e-5, equal_nan=True), o
    # the chunked pass saw the large tensors only: the small ones went together
    assert seen and min(seen) > stats._SPLIT_MAX
    assert len(seen) == sum(t.numel() > stats._SPLIT_MAX for t in ts)


def test_the_split_gives_what_the_whole_list_gave(monkeypatch: pytest.MonkeyPatch) -> None:
    ts = _mixed(1)
    split = [_vector(v) for v in norms(ts, ORDS)]
    monkeypatch.setattr(stats, "_SPLIT_MIN", 10**9)  # no split: every tensor chunked
    whole = [_vector(v) for v in norms(ts, ORDS)]
    for a, b in zip(split, whole):
        assert torch.allclose(a, b, rtol=1e-6, equal_nan=True)


def test_a_complex_small_tensor_leaves_the_list_to_the_general_path() -> None:
    ts = _mixed(2)
    ts[0] = torch.randn(64, dtype=torch.complex64)
    got = norms(ts, ORDS)
    want = _one_at_a_time(ts, 2.0)
    assert torch.allclose(_vector(got[0]), want, rtol=1e-5, equal_nan=True)


def test_a_stale_layout_key_only_changes_the_path() -> None:
    ts = _mixed(3)
    norms(ts, ORDS, "kept")  # the split is remembered for this key and length
    ts[1] = torch.randn(20000)  # a small parameter replaced by a large one, same position
    got = norms(ts, ORDS, "kept")
    for o, v in zip(ORDS, got):
        assert torch.allclose(_vector(v), _one_at_a_time(ts, o), rtol=1e-5, equal_nan=True)
