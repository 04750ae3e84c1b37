"""resume_mismatch on a plain loop: torch.save / torch.load(weights_only=True) of a dict with
the model, optimizer, scheduler and gradwatch state; each way of resuming wrongly is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.resume_mismatch import ResumeMismatch

CFG = {"every_n_steps": 1}


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _steps(model: nn.Module, opt: Any, sched: Any, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _save(tmp: Path, steps: int = 5, extra: Optional[int] = None) -> Path:
    """Train ``steps`` steps and checkpoint; ``extra``: train on and save weights there too."""
    model, opt, sched = _parts()
    path = tmp / "ck.pt"
    with gradwatch.watch(model, opt, config=CFG) as w:
        _steps(model, opt, sched, steps)
        ck = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "gradwatch": w.state_dict(step=steps),
        }
        torch.save(ck, path)
        if extra:
            _steps(model, opt, sched, extra)
            torch.save(model.state_dict(), tmp / "later.pt")
    return path


def _resume(path: Path, skip: tuple[str, ...] = (), step: int = 5, **kw: Any) -> Any:
    ck = torch.load(path, weights_only=True)
    model, opt, sched = _parts()
    if "model" not in skip:
        model.load_state_dict(kw.get("weights") or ck["model"])
    if "opt" not in skip:
        opt.load_state_dict(ck["opt"])
    if "sched" not in skip:
        sched.load_state_dict(ck["sched"])
    with gradwatch.watch(model, opt, config=CFG) as w:
        w.load_state_dict(ck["gradwatch"], step=step)
        _steps(model, opt, sched, 3)
    return w.report()


def _aspects(report: Any) -> dict[str, Any]:
    return {f.details["aspect"]: f for f in report.by_check(ResumeMismatch.id)}


def test_correct_resume_is_silent(tmp_path: Path) -> None:
    report = _resume(_save(tmp_path))
    assert not report.by_check(ResumeMismatch.id), [f.line() for f in report.findings]
    assert report.steps == 8  # the counters continue


def test_gradwatch_state_loaded_before_the_weights_is_silent(tmp_path: Path) -> None:
    path = _save(tmp_path)
    ck = torch.load(path, weights_only=True)
    model, opt, sched = _parts()
    with gradwatch.watch(model, opt, config=CFG) as w:
        w.load_state_dict(ck["gradwatch"])  # the weights come after: compared at the step
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        _steps(model, opt, sched, 2)
    assert not w.report().by_check(ResumeMismatch.id)


def test_fresh_optimizer_after_loading_weights(tmp_path: Path) -> None:
    found = _aspects(_resume(_save(tmp_path), skip=("opt", "sched")))
    assert "optimizer" in found, found
    f = found["optimizer"]
    assert f.severity == "error" and f.first_step == 5
    assert f.details["saved"] == [5.0, 5.0] and "fresh optimizer" in f.message


def test_scheduler_not_restored(tmp_path: Path) -> None:
    found = _aspects(_resume(_save(tmp_path), skip=("sched",)))
    assert set(found) == {"scheduler"}, found
    assert found["scheduler"].details["saved"] == [5]
    assert found["scheduler"].details["resumed"] == [0]


def test_scheduler_built_after_the_optimizer_load_changes_the_lr(tmp_path: Path) -> None:
    path = _save(tmp_path)
    ck = torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model.load_state_dict(ck["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(ck["opt"])
    for group in opt.param_groups:  # a fresh schedule from the configured rate
        group["lr"] = 1e-2
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with gradwatch.watch(model, opt, config=CFG) as w:
        w.load_state_dict(ck["gradwatch"])
        _steps(model, opt, sched, 2)
    found = _aspects(w.report())
    assert "lr" in found, found
    assert found["lr"].details["resumed"] == [1e-2]


def test_weights_from_another_checkpoint(tmp_path: Path) -> None:
    path = _save(tmp_path, extra=2)
    later = torch.load(tmp_path / "later.pt", weights_only=True)
    found = _aspects(_resume(path, weights=later))
    assert set(found) == {"params"}, found
    assert set(found["params"].params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_resume_that_restarts_at_step_zero(tmp_path: Path) -> None:
    found = _aspects(_resume(_save(tmp_path), step=0))
    assert set(found) == {"step"}, found
    assert found["step"].details == {"aspect": "step", "saved": 5, "resumed": 0}


def test_state_is_plain_data_and_off_when_disabled(tmp_path: Path) -> None:
    path = _save(tmp_path)
    state = torch.load(path, weights_only=True)["gradwatch"]
    assert set(state["resume"]) >= {"params", "optimizers", "steps"}
    model, opt, _ = _parts()
    off = {"checks": {ResumeMismatch.id: {"enabled": False}}}
    with gradwatch.watch(model, opt, config=off) as w:
        assert "resume" not in w.state_dict()
        w.load_state_dict(state)
        _steps(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), 1)
    assert not w.report().by_check(ResumeMismatch.id)


@pytest.mark.parametrize("order", ["before_attach"])
def test_loaded_before_attach(tmp_path: Path, order: str) -> None:
    path = _save(tmp_path)
    ck = torch.load(path, weights_only=True)
    model, opt, sched = _parts()
    watcher = gradwatch.watch(model, opt, config=CFG)
    watcher.load_state_dict(ck["gradwatch"])
    with watcher as w:
        _steps(model, opt, sched, 1)
    assert "optimizer" in _aspects(w.report())


def test_sharded_parameters_compare_only_on_the_layout_and_rank_that_saved_them() -> None:
    """FSDP shards differ per rank and reshard on load: the saving rank at the same world
    size compares them; another rank does not; another layout says so (info) and compares
    the counters and rates only."""
    from gradwatch.capture.facts import UNOBSERVABLE
    from gradwatch.capture.loop.resume import compare, snapshot

    w = torch.ones(3)
    saved = snapshot([("w", w)], [], steps=4, world_size=2, sharded=True)
    other = snapshot([("w", w * 2)], [], steps=4, world_size=2, sharded=True)
    assert [f.details["aspect"] for f in compare(saved, other, step=4)] == ["params"]
    assert compare(saved, {**other, "rank": 1}, step=4) == []  # rank 1 holds another shard
    smaller = snapshot([("w", torch.ones(2))], [], steps=4, world_size=2, sharded=True)
    assert compare(saved, smaller, step=4) == []  # another mesh: shards of another size
    (note,) = compare(saved, snapshot([("w", w * 2)], [], 4, 1), step=4)  # resharded at 1
    assert note.kind == UNOBSERVABLE and note.details["reason"] == "resume_resharded"
    plain = snapshot([("w", w)], [], steps=4, world_size=2)
    for world in (2, 1):  # whole parameters compare at any world size
        found = compare(plain, snapshot([("w", w * 2)], [], 4, world), 4)
        assert [f.details["aspect"] for f in found] == ["params"]
