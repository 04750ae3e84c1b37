"""A large tensor's checksum carried from the after-step reading to the next fingerprint.

The carried checksum must equal a fresh read wherever nothing wrote the tensor, a write
through the tensor or of a sampled value must force a fresh read, and an edit the carry
cannot see (through ``.data``, of unsampled values) must never turn into "changed".
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradwatch
from gradwatch.measure import carry, chunked
from gradwatch.measure import fingerprint as sketch
from gradwatch.measure._reads import checksum

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
    keys = [(0, 509, 2), (0, 509, 2)]
    sums = [torch.zeros(1, dtype=torch.int64)] * 2
    carry.remember(ts, keys, sums, [torch.zeros(2)] * 2, torch.ones(2))
    got = carry.take(ts, keys, lambda k: torch.zeros(2))
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


# -- judged by the samples alone: no checksum while a tensor's sampled values move ---------
#
# Where every measured step moved a sampled value, the moved value proves the change and the
# checksum is not taken. What must hold: the results equal the checksummed ones wherever a
# sampled value moves; a step that moves none is unknown (NaN), never "unchanged"; from then
# on the tensor is checksummed again, so "unchanged" is exact; under ``torch.distributed``
# (the replicas' check reads the checksums) it is off.


def _round(ts: list[torch.Tensor], move: bool = True) -> tuple[sketch.Fingerprint, sketch.Measured]:
    """One observed step: fingerprint, the step (if ``move``), measure."""
    fp = sketch.fingerprint(ts)
    if move:
        _step(ts)
    return fp, sketch.measure(ts, fp)


def _sums_taken(monkeypatch: pytest.MonkeyPatch) -> list[list[bool]]:
    """Spy: per call of the after-step pass, which tensors got an integer sum."""
    calls: list[list[bool]] = []
    real = chunked.norms_and_checksums

    def spy(tensors, samples=(), no_sum=()):  # type: ignore[no-untyped-def]
        calls.append([not (no_sum and no_sum[k]) for k in range(len(tensors))])
        return real(tensors, samples, no_sum)

    monkeypatch.setattr(sketch, "norms_and_checksums", spy)
    return calls


def _sequence(steps: int) -> list[tuple[object, list[float], list[float], list[float]]]:
    """Per observed step of a fresh copy: (by_samples, changed, delta, param norms)."""
    carry.forget()
    ts = _tensors()
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        fp, m = _round(ts)
        assert m.changed is not None and m.delta is not None
        out.append((fp.by_samples, m.changed.tolist(), m.delta.tolist(), m.param_norm.tolist()))
    return out


def test_moving_tensors_take_no_checksum_and_give_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _sums_taken(monkeypatch)
    shipped = _sequence(4)
    assert calls == [[True, True], [False, False], [False, False], [False, False]]
    assert [b for b, *_ in shipped] == [None, [True, True], [True, True], [True, True]]
    monkeypatch.setattr(carry, "still", lambda t: True)  # every large tensor checksummed
    checksummed = _sequence(4)
    assert [b for b, *_ in checksummed] == [None] * 4
    assert [r[1:] for r in shipped] == [r[1:] for r in checksummed]
    assert all(r[1] == [1.0] * 3 for r in shipped)


def test_a_step_that_moves_no_sampled_value_is_unknown_then_exact() -> None:
    ts = _tensors()
    _round(ts)
    fp, _ = _round(ts)
    assert fp.by_samples == [True, True]
    fp, m = _round(ts, move=False)  # the step changed nothing
    assert fp.by_samples == [True, True]
    changed = m.changed.tolist()  # type: ignore[union-attr]
    assert changed[0] == 0.0 and math.isnan(changed[1]) and math.isnan(changed[2])
    fp, m = _round(ts, move=False)  # checksummed again: "unchanged" is exact
    assert fp.by_samples is None
    assert m.changed.tolist() == [0.0] * 3 and m.delta.tolist() == [0.0] * 3  # type: ignore[union-attr]
    fp, m = _round(ts)  # and stays checksummed, though it moves again
    assert fp.by_samples is None and m.changed.tolist() == [1.0] * 3  # type: ignore[union-attr]
    fp, _ = _round(ts)
    assert fp.by_samples is None


def test_a_change_no_sample_sees_is_never_unchanged() -> None:
    ts = _tensors()
    _round(ts)
    fp = sketch.fingerprint(ts)
    assert fp.by_samples == [True, True]
    (b,) = [b for b in fp.plan.big if b.position == 2]
    with torch.no_grad():
        ts[2].view(-1)[b.offset + 1] += 1.0  # a sparse step: one unsampled value
    changed = sketch.measure(ts, fp).changed.tolist()  # type: ignore[union-attr]
    assert math.isnan(changed[1]) and math.isnan(changed[2])  # unknown: never 0.0
    fp = sketch.fingerprint(ts)  # both read before this step: exact both sides
    assert fp.by_samples is None and fp.carried is None
    with torch.no_grad():
        ts[2].view(-1)[b.offset + 1] += 1.0  # the same sparse step
    m = sketch.measure(ts, fp)
    assert m.changed.tolist()[2] == 1.0  # type: ignore[union-attr]
    assert m.delta.tolist()[2] == pytest.approx(sketch.TINY)  # type: ignore[union-attr]
    fp, m = _round(ts, move=False)  # carried from here on, as before this mode
    assert fp.by_samples is None and fp.carried.tolist() == [True, True]  # type: ignore[union-attr]
    assert m.changed.tolist() == [0.0] * 3  # type: ignore[union-attr]


def test_a_write_between_steps_forces_a_checksum() -> None:
    """A write through the tensor (its counter moves): the entry is void, the tensor read."""
    ts = _tensors()
    _round(ts)
    _round(ts)
    with torch.no_grad():
        ts[1].mul_(1.0)
    fp = sketch.fingerprint(ts)
    assert fp.by_samples == [False, True]
    assert fp.checksums[1].tolist() == checksum(ts[1]).tolist()


def test_off_under_torch_distributed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ts = _tensors()
        for _ in range(3):
            fp = sketch.fingerprint(ts)
            assert fp.by_samples is None
            assert [c.tolist() for c in fp.checksums[-2:]] == [checksum(t).tolist() for t in ts[1:]]
            _step(ts)
            sketch.measure(ts, fp)
    finally:
        dist.destroy_process_group()


def test_a_training_run_reports_what_checksums_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every-step statistics on a real loop, once as shipped and once with every large tensor
    checksummed: the same report, and a layer whose lr drops to 0 is still found stale."""

    def run() -> gradwatch.Report:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Linear(512, 8))
        head = list(model[2].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in head)]
        opt = torch.optim.SGD([{"params": rest}, {"params": head}], lr=0.05)
        x, y = torch.randn(32, 64), torch.randn(32, 8)
        cfg = {"every_n_steps": 1, "probes": "off"}
        with gradwatch.watch(model, opt, config=cfg) as w:
            for step in range(12):
                if step == 5:
                    opt.param_groups[1]["lr"] = 0.0
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return w.report()

    shipped = run()
    monkeypatch.setattr(carry, "still", lambda t: True)
    checksummed = run()
    assert [(f.check, f.params) for f in shipped.findings] == [
        (f.check, f.params) for f in checksummed.findings
    ]
    stale = [f for f in shipped.findings if f.check == "stale_param"]
    assert stale and any("2.weight" in p for f in stale for p in f.params)


def test_the_kept_sample_stands_for_the_one_before_when_the_probe_agrees() -> None:
    ts = _tensors()
    _round(ts)
    _round(ts)
    fp = sketch.fingerprint(ts)
    assert fp.by_samples == [True, True]
    j = len(fp.plan.groups)  # the large tensors' samples follow the groups'
    for i, b in enumerate(fp.plan.big):
        fresh = sketch.sample(ts[b.position], b)  # what a gather reads now: the same values
        assert torch.equal(fp.samples[j + i], fresh)


@pytest.mark.parametrize("probed", [True, False])
def test_a_data_edit_between_steps_and_the_probe(probed: bool) -> None:
    """A probed value edited through ``.data`` voids the carry (read afresh); an unprobed one
    is counted in the next update, which only ever looks larger, never unchanged."""
    ts = _tensors()
    _round(ts)
    fp0, _ = _round(ts)
    (b,) = [b for b in fp0.plan.big if b.position == 1]
    at = b.offset + (0 if probed else 1) * b.stride  # sample 0 is probed, sample 1 is not
    ts[1].data.view(-1)[at] += 1.0
    fp = sketch.fingerprint(ts)
    assert fp.by_samples == ([False, True] if probed else [True, True])
    m = sketch.measure(ts, fp)  # no step: only the edit moved anything
    changed = m.changed.tolist()  # type: ignore[union-attr]
    if probed:  # read afresh before the "step": the edit is before it, nothing changed
        assert changed[1] == 0.0
    else:  # the kept sample is from before the edit: the edit reads as this step's change
        assert changed[1] == 1.0 and m.delta.tolist()[1] > 0  # type: ignore[union-attr]
