"""Reading arrivals at the step changes no finding on real architectures (capture/grads/step_reading.py).

Each architecture (transformers, tiny configs, including the MoE ones whose experts skip
steps) trains 20 seeded steps with the default configuration twice: once with the reading
off, once with it on for nearly every parameter (its size threshold and sample lowered so
that these tiny models are read as a large one would be). Both runs must train identically
and produce the same findings, details included.
"""

from __future__ import annotations

import json

import pytest
import torch
from _architectures import ARCHITECTURES, SWEEP_MARKS

import gradwatch
from gradwatch.capture.grads import step_reading

pytest.importorskip("transformers")

pytestmark = SWEEP_MARKS

STEPS = 20


def _run(name: str) -> tuple[list[float], set[tuple[str, ...]], int]:
    torch.manual_seed(0)
    model, make_batch = ARCHITECTURES[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(g) for _ in range(4)]
    losses: list[float] = []
    read = 0
    cfg = {"warn": False, "on_internal_error": "raise"}
    with gradwatch.watch(model, opt, config=cfg) as w:
        torch.manual_seed(2)  # dropout and LayerDrop draw the same in both runs
        for s in range(STEPS):
            opt.zero_grad()
            loss = model(**batches[s % len(batches)]).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            read = max(read, len(w._hooks.unhooked))
    report = w.report()
    assert report.steps == STEPS
    found = {
        (f.check, f.severity, *sorted(f.params), json.dumps(f.details, sort_keys=True))
        for f in report.findings
    }
    return losses, found, read


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_reading_changes_no_finding(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_reading, "MIN_READ", 10**9)
    want_losses, want, never = _run(name)
    monkeypatch.setattr(step_reading, "MIN_READ", 4)
    monkeypatch.setattr(step_reading, "SENTINELS", 2)
    monkeypatch.setattr(step_reading, "ROTATE", 2)
    losses, found, read = _run(name)
    assert never == 0
    assert read > 0, "the reading never started: the comparison proves nothing"
    assert losses == want_losses
    assert found == want
