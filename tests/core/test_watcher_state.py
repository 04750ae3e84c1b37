"""The watcher's public API for adapters: checkpoint state, faults, findings (issue 28)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.ghost import GhostParam


class Ghosted(nn.Module):
    """``ghost`` is trainable and never used: a ghost layer."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.ghost = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()


def _run(steps: int, state: Any = None, *, before_attach: bool = False) -> Any:
    torch.manual_seed(0)
    model = Ghosted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = gradwatch.watch(model, opt, config={"every_n_steps": 1})
    if state is not None and before_attach:
        watcher.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watcher:
            if state is not None and not before_attach:
                watcher.load_state_dict(state)
            _train(model, opt, steps)
    warned = [w for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)]
    return watcher, warned


def _through_torch_save(state: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("before_attach", [False, True])
def test_state_dict_round_trip_continues_findings_and_counters(before_attach: bool) -> None:
    first, warned = _run(3)
    assert warned  # the ghost warned once in the first run
    state = _through_torch_save(first.state_dict())
    assert state["steps"] == 3 and state["optimizer_steps"] == {"0": 3}

    second, warned = _run(2, state, before_attach=before_attach)
    assert not warned  # already warned before the checkpoint
    report = second.report()
    assert report.steps == 5
    (ghost,) = report.by_check(GhostParam.id)
    assert (ghost.first_step, ghost.last_step, ghost.count) == (0, 4, 5)
    assert second.state_dict()["optimizer_steps"] == {"0": 5}


def test_load_state_dict_rejects_foreign_state_and_closed_watcher() -> None:
    watcher, _ = _run(1)
    state = watcher.state_dict()
    with pytest.raises(gradwatch.GradWatchError, match="closed"):
        watcher.load_state_dict(state)
    fresh = gradwatch.watch(Ghosted())
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="do not match"):
        fresh.load_state_dict({**state, "finding_keys": []})


def test_findings_are_copies_filtered_by_check() -> None:
    watcher, _ = _run(2)
    (ghost,) = watcher.findings(GhostParam.id)
    assert ghost.module == "ghost"
    ghost.params.clear()
    assert watcher.findings(GhostParam.id)[0].params == ["ghost.weight", "ghost.bias"]
    assert len(watcher.findings()) >= 1


def test_record_fault_is_one_internal_error_per_place() -> None:
    model = Ghosted()
    with gradwatch.watch(model, config={"warn": False}) as watcher:
        watcher.note_backward_requested()
        for _ in range(2):
            watcher.record_fault("upload", RuntimeError("server down"))
    (fault,) = watcher.findings("internal_error")
    assert fault.details["where"] == "upload" and "server down" in fault.details["error"]


def test_record_fault_raises_with_on_internal_error_raise() -> None:
    with gradwatch.watch(Ghosted(), config={"on_internal_error": "raise"}) as watcher:
        with pytest.raises(RuntimeError, match="boom"):
            watcher.record_fault("upload", RuntimeError("boom"))
