"""The small tensors' after-step reading, carried to the next step's fingerprint.

A carried fingerprint must equal a fresh one wherever nothing wrote the tensors; a write
through a tensor (its version counter), a step that was not measured in between, or a
resize must force a fresh read; and the update ratio of a real every-step loop must stay the
exact one while the carry serves every fingerprint after the first.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.measure import carry_groups
from gradwatch.measure import fingerprint as sketch


@pytest.fixture(autouse=True)
def _fresh() -> None:
    carry_groups.forget()


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # two groups: 12 same-shape weights (stacked) and mixed small shapes (flattened)
    return [torch.randn(8, 8, generator=g) for _ in range(12)] + [
        torch.randn(s, generator=g) for s in [(5,), (3, 7), (100,)]
    ]


def _step(ts: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in ts:
            t.add_(1e-3 * torch.randn_like(t))


def _lists(fp: sketch.Fingerprint) -> tuple[list[list[int]], list[list[float]]]:
    return [c.tolist() for c in fp.checksums], [s.tolist() for s in fp.samples]


def test_a_carried_fingerprint_is_the_fresh_one_and_so_are_the_results() -> None:
    ts = _tensors()
    sketch.measure(ts, sketch.fingerprint(ts), step=0)  # step 0 measured: kept for step 1
    carried = sketch.fingerprint(ts, step=1)
    assert carried.plan is sketch.cached_plan(ts)
    fresh = sketch.fingerprint(ts)
    assert _lists(carried) == _lists(fresh)
    _step(ts)
    a, b = sketch.measure(ts, carried), sketch.measure(ts, fresh)
    assert a.changed.tolist() == b.changed.tolist() == [1.0] * len(ts)  # type: ignore[union-attr]
    assert a.delta.tolist() == b.delta.tolist()  # type: ignore[union-attr]


def test_the_carry_is_used_once_and_only_for_the_next_step() -> None:
    ts = _tensors()
    sketch.measure(ts, step=4)
    assert carry_groups.take(sketch._key(ts), ts, 6) is None  # a step in between: refused
    sketch.measure(ts, step=4)
    assert carry_groups.take(sketch._key(ts), ts, 5) is not None
    assert carry_groups.take(sketch._key(ts), ts, 5) is None  # one use


def test_a_write_through_a_tensor_between_steps_forces_a_fresh_read() -> None:
    ts = _tensors()
    sketch.measure(ts, step=0)
    with torch.no_grad():
        ts[13].mul_(2.0)  # bumps its version counter
    fp = sketch.fingerprint(ts, step=1)
    fresh = sketch.fingerprint(ts)
    assert _lists(fp) == _lists(fresh)  # read now, with the write in it
    _step(ts)
    assert sketch.measure(ts, fp).changed.tolist() == [1.0] * len(ts)  # type: ignore[union-attr]


def test_nothing_written_stays_exactly_unchanged_when_carried() -> None:
    ts = _tensors()
    sketch.measure(ts, step=0)
    m = sketch.measure(ts, sketch.fingerprint(ts, step=1))
    assert m.changed.tolist() == [0.0] * len(ts)  # type: ignore[union-attr]
    assert m.delta.tolist() == [0.0] * len(ts)  # type: ignore[union-attr]


def test_a_write_through_data_is_measured_with_the_next_update() -> None:
    """What no counter sees is part of the next reading (it did move the tensor)."""
    ts = _tensors()
    sketch.measure(ts, step=0)
    ts[0].data.add_(1.0)  # no version bump
    fp = sketch.fingerprint(ts, step=1)
    m = sketch.measure(ts, fp)
    assert m.changed.tolist()[0] == 1.0  # type: ignore[union-attr]
    assert m.delta.tolist()[0] > 1.0  # type: ignore[union-attr]


def test_a_resize_since_the_plan_is_refused_not_misread() -> None:
    ts = _tensors()
    fp = sketch.fingerprint(ts)
    ts[13].data = torch.randn(3, 8)  # a member of the flattened group grows
    with pytest.raises(ValueError):
        sketch.measure(ts, fp)


def _exact_ratios(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, mod in model.named_children():
        after = [p.detach() for p in mod.parameters()]
        was = [before[f"{name}.{k}"] for k, _ in mod.named_parameters()]
        if not after:
            continue
        delta = torch.cat([(a - b).reshape(-1) for a, b in zip(after, was)]).norm()
        out[name] = float(delta / torch.cat([a.reshape(-1) for a in after]).norm())
    return out


def test_every_step_update_ratios_stay_exact_while_the_carry_serves() -> None:
    """Tensors of at most 64 values are sampled whole: the update ratio is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(6, 6), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 6), torch.randn(16, 6)
    took = []
    real_take = carry_groups.take

    def counting(*args):  # type: ignore[no-untyped-def]
        found = real_take(*args)
        took.append(found is not None)
        return found

    carry_groups.take = counting
    try:
        with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
            for _ in range(8):
                before = {k: v.detach().clone() for k, v in model.named_parameters()}
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    finally:
        carry_groups.take = real_take
    assert took[0] is False and all(took[1:]) and len(took) == 8
    stats = {s.name: s for s in w.report().layers}
    for name, ratio in _exact_ratios(model, before).items():
        assert stats[name].update_ratio == pytest.approx(ratio, rel=1e-4), name
