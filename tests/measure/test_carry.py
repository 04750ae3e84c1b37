"""A large tensor's checksum carried from the after-step reading to the next fingerprint.

The carried checksum must equal a fresh read wherever nothing wrote the tensor, a write
through the tensor or of a sampled value must force a fresh read, and an edit the carry
cannot see (through ``.data``, of unsampled values) must never turn into "changed".
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.measure import carry
from gradwatch.measure import fingerprint as sketch

SHAPES = [(16, 16), (300, 400), (1 << 17,)]  # one small group, two large tensors


@pytest.fixture(autouse=True)
def _fresh() -> None:
    carry.forget()


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _step(ts: list[torch.Tensor], scale: float = 1e-3) -> None:
    with torch.no_grad():
        for t in ts:
            t.add_(scale * torch.randn_like(t))


def _unsampled(fp: sketch.Fingerprint, k: int) -> int:
    """A flat position of ``ts[k]`` (a large one) that its fingerprint does not sample."""
    (b,) = [b for b in fp.plan.big if b.position == k]
    return b.offset + 1  # between two samples (the stride is 509)


def test_a_carried_checksum_is_the_fresh_one_and_so_are_the_results() -> None:
    ts = _tensors()
    sketch.measure(ts, sketch.fingerprint(ts))  # an after-step reading: remembered
    fp = sketch.fingerprint(ts)
    assert fp.carried is not None and fp.carried.tolist() == [True, True]
    carry.forget()
    fresh = sketch.fingerprint(ts)
    assert fresh.carried is None
    assert [c.tolist() for c in fp.checksums] == [c.tolist() for c in fresh.checksums]
    _step(ts)
    a, b = sketch.measure(ts, fp), sketch.measure(ts, fresh)
    assert a.changed.tolist() == b.changed.tolist() == [1.0, 1.0, 1.0]  # type: ignore[union-attr]
    assert a.delta.tolist() == b.delta.tolist()  # type: ignore[union-attr]


def test_nothing_changed_stays_exactly_zero_when_carried() -> None:
    ts = _tensors()
    sketch.measure(ts, sketch.fingerprint(ts))
    fp = sketch.fingerprint(ts)
    assert fp.carried is not None
    m = sketch.measure(ts, fp)
    assert m.changed.tolist() == [0.0] * 3 and m.delta.tolist() == [0.0] * 3  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["in_place", "sampled_data_edit"])
def test_a_write_it_can_see_forces_a_fresh_read(how: str) -> None:
    ts = _tensors()
    fp0 = sketch.fingerprint(ts)
    sketch.measure(ts, fp0)
    (b,) = [b for b in fp0.plan.big if b.position == 1]
    with torch.no_grad():
        if how == "in_place":  # bumps the version counter
            ts[1].view(-1)[_unsampled(fp0, 1)] += 1.0
        else:  # .data keeps the counter; the sample sees the value
            ts[1].data.view(-1)[b.offset] += 1.0
    fp = sketch.fingerprint(ts)
    assert fp.carried is not None and fp.carried.tolist() == [False, True]
    m = sketch.measure(ts, fp)  # no step: nothing changed since this fingerprint
    assert m.changed.tolist() == [0.0] * 3  # type: ignore[union-attr]


def test_an_unseen_data_edit_is_unknown_never_changed() -> None:
    ts = _tensors()
    fp0 = sketch.fingerprint(ts)
    sketch.measure(ts, fp0)
    ts[1].data.view(-1)[_unsampled(fp0, 1)] += 1.0  # between the steps, unseen
    fp = sketch.fingerprint(ts)
    assert fp.carried is not None and fp.carried.tolist() == [True, True]  # stale for ts[1]
    m = sketch.measure(ts, fp)  # the "step" changed nothing
    changed = m.changed.tolist()  # type: ignore[union-attr]
    assert changed[0] == changed[2] == 0.0 and math.isnan(changed[1])
    assert math.isnan(m.delta.tolist()[1])  # type: ignore[union-attr]


def test_a_step_that_moves_sampled_values_is_changed_even_when_carried() -> None:
    ts = _tensors()
    fp0 = sketch.fingerprint(ts)
    sketch.measure(ts, fp0)
    ts[1].data.view(-1)[_unsampled(fp0, 1)] += 1.0  # an unseen edit, then a real step
    fp = sketch.fingerprint(ts)
    _step(ts)
    assert sketch.measure(ts, fp).changed.tolist() == [1.0, 1.0, 1.0]  # type: ignore[union-attr]


def test_no_carry_off_the_cpu() -> None:
    ts = [torch.empty(s, device="meta") for s in SHAPES[1:]]
    sums = [torch.zeros(1, dtype=torch.int64)] * 2
    carry.remember(ts, [(0, 509, 2), (0, 509, 2)], sums, [], [True, True])
    got = carry.take(ts, [(0, 509, 2), (0, 509, 2)], [])
    assert got.checksums == [None, None] and got.by_samples == [False, False]


def test_a_frozen_large_layer_edited_through_data_between_steps_is_not_accused() -> None:
    """Every-step statistics on a real loop: a frozen layer whose padding row is zeroed
    through ``.data`` after each step (unsampled values) is never reported as updated."""
    torch.manual_seed(0)
    emb = nn.Embedding(4000, 64)
    emb.weight.requires_grad_(False)
    head = nn.Linear(64, 4000)
    model = nn.Sequential(emb, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the frozen weight too
    rows = torch.randint(1, 4000, (20, 8))
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "probes": "off"}) as w:
        for step in range(6):
            opt.zero_grad()
            logits = model(rows)
            nn.functional.cross_entropy(logits.view(-1, 4000), rows.view(-1)).backward()
            opt.step()
            emb.weight.data[step + 1].zero_()  # a new row each time: the values change
    assert not [f for f in w.report().findings if f.check == "frozen_param_updated"]


def test_a_fused_optimizer_step_bumps_no_counter_and_is_still_read() -> None:
    """Unobserved fused steps between two readings: the sample sees them, the tensor is read."""
    p = nn.Parameter(torch.randn(300, 400))
    opt = torch.optim.Adam([p], lr=1e-2, fused=True)
    sketch.measure([p], sketch.fingerprint([p]))
    version = p._version
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    assert p._version == version  # what the counter alone would have missed
    fp = sketch.fingerprint([p])
    assert fp.carried is None  # read afresh: its sample had moved
    carry.forget()
    assert fp.checksums[0].tolist() == sketch.fingerprint([p]).checksums[0].tolist()


def test_inference_tensors_are_read_not_carried() -> None:
    with torch.inference_mode():
        ts = _tensors()
    sketch.measure(ts, sketch.fingerprint(ts))  # no version counter: nothing kept, no error
    assert sketch.fingerprint(ts).carried is None
