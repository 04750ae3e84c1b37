"""torch.compile: watching must not change how the model compiles, and still finds ghosts.

Dynamo guards on whatever a traced hook reads; a forward hook that reads gradwatch's event
counter made every step recompile until dynamo gave up and ran the model eagerly. Counted
here with dynamo's own counters and a counting backend, watched against unwatched.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import gradwatch

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounter  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

STEPS = 12  # past dynamo's recompile limit (8), where a per-step recompile would show


class Net(nn.Module):
    """``ghost`` is never called; ``side`` runs but its output is dropped (``disconnected``)."""

    def __init__(self, ghosts: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)
        self.ghost = nn.Linear(8, 8) if ghosts else None
        self.side = nn.Linear(8, 8) if ghosts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side is not None:
            self.side(x)  # computed, never used: the loss does not depend on it
        return self.b(torch.tanh(self.a(x)))


def _run(watched: bool, ghosts: bool) -> tuple[dict[str, Any], Optional[gradwatch.Report]]:
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net(ghosts)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    watcher = gradwatch.watch(compiled, opt, config={"every_n_steps": 1}) if watched else None
    if watcher is not None:
        watcher.attach()
    try:
        for _ in range(STEPS):
            opt.zero_grad()
            compiled(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        with torch.no_grad():  # an evaluation pass: one more graph, watched or not
            compiled(torch.randn(4, 8))
    finally:
        if watcher is not None:
            watcher.close()
    stats = {
        "frames": backend.frame_count,
        "ops": backend.op_count,
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
    }
    return stats, watcher.report() if watcher is not None else None


@pytest.mark.parametrize("ghosts", [False, True])
def test_watching_adds_no_recompile_and_no_graph_break(ghosts: bool) -> None:
    plain, _ = _run(watched=False, ghosts=ghosts)
    watched, report = _run(watched=True, ghosts=ghosts)
    assert plain["graph_breaks"] == 0
    assert watched == plain  # same frames compiled, same graphs, same ops, no break
    assert report is not None and report.steps == STEPS  # step hooks fire after compile


def test_ghosts_are_found_with_their_cause_under_compile() -> None:
    _, report = _run(watched=True, ghosts=True)
    assert report is not None
    causes = {f.module: f.details["cause"] for f in report.by_check("ghost_param")}
    # Both found; a compiled layer leaves no forward stamp, so the cause is not guessed.
    assert causes == {"ghost": "unknown", "side": "unknown"}
    assert report.steps == STEPS


def test_clean_compiled_model_is_silent() -> None:
    _, report = _run(watched=True, ghosts=False)
    assert report is not None
    assert [f.line() for f in report.findings if f.severity != "info"] == []
    # what the compiled run could not check is said, not passed over
    # one finding (issue 51.6) listing every part compile hides: the forward hooks and each
    # evidence source that reads the forward (section 7)
    (blind,) = report.by_check("not_observed")
    assert blind.severity == "info" and blind.details["reason"] == "compiled_forward"
    parts = blind.details["by_part"]
    assert set(parts) == {"forward_hooks", "loss_graph", "eval_forward", "loss_inputs"}
    assert "loss_disconnected" in parts["forward_hooks"]
    assert "eval_forward_stochastic" in parts["eval_forward"]
    assert set(blind.details["checks"]) == {c for named in parts.values() for c in named}
    assert not report.failed


def test_step_hooks_still_fire_after_an_unrelated_compile() -> None:
    """torch 2.1 stopped calling optimizer step hooks once anything was compiled."""
    dynamo.reset()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    model = Net(ghosts=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt) as watcher:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    report = watcher.report()
    assert report.steps == 3
    causes = {f.module: f.details["cause"] for f in report.by_check("ghost_param")}
    assert causes == {"ghost": "not_called", "side": "disconnected"}  # eager: causes known


@pytest.mark.slow  # inductor generates and compiles C++: tens of seconds
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")  # inductor's
def test_inductor_graphs_are_the_same_watched_or_not() -> None:
    def graphs(watched: bool) -> tuple[int, int, int]:
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Net(ghosts=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        compiled = torch.compile(model)  # the default backend
        watcher = gradwatch.watch(compiled, opt).attach() if watched else None
        for _ in range(10):
            opt.zero_grad()
            compiled(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        if watcher is not None:
            watcher.close()
            assert watcher.report().by_check("ghost_param")
        return (
            counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()),
            sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        )

    assert graphs(watched=True) == graphs(watched=False)


def test_compiled_model_that_never_steps_is_not_a_pass() -> None:
    """The wrapper's own (eager) hook tells that the model ran: not_observed still fires."""
    dynamo.reset()
    model = Net(ghosts=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend=CompileCounter())
    with gradwatch.watch(compiled, opt) as watcher:
        for _ in range(3):
            compiled(torch.randn(4, 8))  # forward only: nothing is trained nor judged
    report = watcher.report()
    assert report.by_check("not_observed") and report.failed
