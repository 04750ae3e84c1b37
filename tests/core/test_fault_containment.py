"""A fault inside gradwatch never breaks the training run it watches.

Faults are injected into gradwatch's own internals (never into torch) at every hook point:
the training run must go on with exactly the losses of an unwatched run, the report must hold
exactly one ``internal_error`` finding naming the hook point, and with
``on_internal_error="raise"`` the fault must propagate instead.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import gradwatch
import gradwatch.core.gather
import gradwatch.core.steps
import gradwatch.report_io
from gradwatch.checks.ghost import GhostParam
from gradwatch.checks.vanishing import VanishingGrad
from gradwatch.errors import GradWatchWarning

STEPS = 6


class Injected(RuntimeError):
    """The fault the tests plant inside gradwatch."""


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise Injected("injected fault")


class RaisingList(list):  # type: ignore[type-arg]
    """A per-parameter state list of the tracker whose writes fail."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Injected("injected fault in a tracker list")


class RaisingDict(dict):  # type: ignore[type-arg]
    """A tracker dict whose writes fail."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Injected("injected fault in a tracker dict")


class RecordingSink:
    """A metric sink that records what it is given."""

    def __init__(self) -> None:
        self.logged: list[int] = []
        self.closed = False

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append(step)

    def close(self) -> None:
        self.closed = True


class FaultySink(RecordingSink):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise Injected("sink is broken")


class FaultyCloseSink(RecordingSink):
    def close(self) -> None:
        raise Injected("sink close is broken")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def train(
    model: nn.Module,
    opt: Optional[torch.optim.Optimizer],
    during: Optional[Callable[[], None]] = None,
) -> list[float]:
    """An ordinary loop; ``opt=None`` updates by hand (each backward is a step then)."""
    losses = []
    for x, y in batches():
        if during is not None:
            during()
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if opt is not None:
            opt.step()
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        losses.append(loss.item())
    return losses


def baseline(with_optimizer: bool) -> tuple[list[float], list[torch.Tensor]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if with_optimizer else None
    losses = train(model, opt)
    return losses, [p.detach().clone() for p in model.parameters()]


@dataclass
class Fault:
    """How to plant one fault, and the hook point it must be reported under."""

    where: str
    plant: Callable[[pytest.MonkeyPatch, gradwatch.Watcher], None]
    optimizer: bool = True
    before_attach: Optional[Callable[[pytest.MonkeyPatch], None]] = None
    sink: Optional[type[RecordingSink]] = None
    config: Optional[dict[str, Any]] = None


def _tracker_list(name: str) -> Callable[[pytest.MonkeyPatch, gradwatch.Watcher], None]:
    def plant(mp: pytest.MonkeyPatch, w: gradwatch.Watcher) -> None:
        mp.setattr(w._tracker, name, RaisingList(getattr(w._tracker, name)))

    return plant


def _tracker_dict(name: str) -> Callable[[pytest.MonkeyPatch, gradwatch.Watcher], None]:
    def plant(mp: pytest.MonkeyPatch, w: gradwatch.Watcher) -> None:
        mp.setattr(w._tracker, name, RaisingDict())

    return plant


def _nothing(mp: pytest.MonkeyPatch, w: gradwatch.Watcher) -> None:
    return None


FAULTS = {
    # the tensor hook that runs before a gradient is accumulated into .grad
    "pre_accumulate": Fault("pre-accumulate hook", _tracker_list("incoming")),
    # the hook that runs after .grad was written
    "post_accumulate": Fault("post-accumulate hook", _tracker_list("acc_ref")),
    # the autograd-engine callback at the end of backward (decides steps without optimizer)
    "backward_end": Fault(
        "backward end",
        lambda mp, w: mp.setattr(gradwatch.core.steps, "gather", _boom),
        optimizer=False,
    ),
    "optimizer_pre_step": Fault(
        "optimizer pre-step hook", lambda mp, w: mp.setattr(w._pipe, "before_step", _boom)
    ),
    # the step decision: gradient norms fail inside gather()
    "optimizer_post_step": Fault(
        "optimizer step hook",
        lambda mp, w: mp.setattr(gradwatch.core.gather, "vector_norms", _boom),
    ),
    "forward": Fault("forward hook", _tracker_dict("fwd_grad")),
    "sink": Fault("sink", _nothing, sink=FaultySink),
    "sink_close": Fault("sink close", _nothing, sink=FaultyCloseSink),
    "check_on_step": Fault(
        "ghost_param check", lambda mp, w: mp.setattr(GhostParam, "on_step", _boom)
    ),
    "check_on_structure": Fault(
        "vanishing_grad check",
        _nothing,
        before_attach=lambda mp: mp.setattr(VanishingGrad, "on_structure", _boom),
    ),
    "exit": Fault("exit", lambda mp, w: mp.setattr(w._pipe, "check_scaler", _boom)),
}


def run_with_fault(
    mp: pytest.MonkeyPatch, fault: Fault, tmp_path: Path, *, strict: bool = False
) -> tuple[gradwatch.Watcher, list[float], nn.Module, Optional[RecordingSink]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if fault.optimizer else None
    sink = fault.sink() if fault.sink is not None else None
    config: dict[str, Any] = {"every_n_steps": 1, "report_path": str(tmp_path / "report.json")}
    config.update(fault.config or {})
    if strict:
        config["on_internal_error"] = "raise"
    if fault.before_attach is not None:
        fault.before_attach(mp)
    losses: list[float] = []
    with gradwatch.watch(model, opt, config=config, sinks=[sink] if sink else []) as w:
        fault.plant(mp, w)
        losses = train(model, opt)
    return w, losses, model, sink


@pytest.mark.parametrize("point", sorted(FAULTS))
def test_fault_is_contained_and_reported_once(
    point: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fault = FAULTS[point]
    want_losses, want_params = baseline(fault.optimizer)
    with (
        caplog.at_level(logging.WARNING, logger="gradwatch"),
        pytest.warns(gradwatch.GradWatchWarning) as record,
    ):
        w, losses, model, _ = run_with_fault(monkeypatch, fault, tmp_path)

    # training was not disturbed: bit-identical trajectory and weights
    assert losses == want_losses
    for p, q in zip(model.parameters(), want_params):
        assert torch.equal(p.detach(), q)

    report = w.report()
    errors = report.by_check("internal_error")
    assert len(errors) == 1, [f.line() for f in errors]
    (err,) = errors
    assert err.details["where"] == fault.where
    assert "Injected" in err.details["error"]
    assert "Injected" in err.details["traceback"]
    assert err.severity == "warning"
    # the report written at exit holds it too (faults at exit included)
    written = gradwatch.Report.read(tmp_path / "report.json")
    assert [f.details["where"] for f in written.by_check("internal_error")] == [fault.where]

    # reported once: one GradWatchWarning and one log record for the fault
    internal = [r for r in record if "internal_error" in str(r.message)]
    assert len(internal) == 1
    logged = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(logged) == 1
    assert fault.where in logged[0].getMessage()


@pytest.mark.parametrize("point", sorted(FAULTS))
def test_fault_propagates_with_on_internal_error_raise(
    point: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fault = FAULTS[point]
    model_ref: list[nn.Module] = []
    with pytest.raises(Injected):
        model = make_model()
        model_ref.append(model)
        run_strict(monkeypatch, fault, tmp_path, model)
    # even a strict failure leaves no hook behind
    model = model_ref[0]
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
        assert not p._backward_hooks
    for m in model.modules():
        assert not m._forward_hooks


def run_strict(mp: pytest.MonkeyPatch, fault: Fault, tmp_path: Path, model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if fault.optimizer else None
    sink = fault.sink() if fault.sink is not None else None
    config: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise"}
    if fault.before_attach is not None:
        fault.before_attach(mp)
    with gradwatch.watch(model, opt, config=config, sinks=[sink] if sink else []) as w:
        fault.plant(mp, w)
        train(model, opt)


def test_faults_at_several_hook_points_do_not_stop_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    want_losses, _ = baseline(True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}, sinks=[FaultySink()]) as w:
        for name in ("incoming", "acc_ref"):
            monkeypatch.setattr(w._tracker, name, RaisingList(getattr(w._tracker, name)))
        monkeypatch.setattr(w._tracker, "fwd_grad", RaisingDict())
        monkeypatch.setattr(gradwatch.core.gather, "vector_norms", _boom)
        losses = train(model, opt)
    assert losses == want_losses
    where = sorted(f.details["where"] for f in w.report().by_check("internal_error"))
    # the sink is never reached: the step decision fails before it
    assert where == sorted(
        ["pre-accumulate hook", "post-accumulate hook", "forward hook", "optimizer step hook"]
    )


def test_fault_in_forward_hook_under_no_grad_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    with gradwatch.watch(model, None) as w:
        monkeypatch.setattr(w._tracker, "fwd_nograd", RaisingDict())
        with torch.no_grad():
            out = model(torch.randn(2, 6))
    assert out.shape == (2, 2)
    assert [f.details["where"] for f in w.report().by_check("internal_error")] == ["forward hook"]


def _block(folder: Path) -> None:
    """Make ``folder`` unusable after watching started (a report_path unwritable at attach
    is refused then: see tests/report/test_report_io.py)."""
    shutil.rmtree(folder)  # it may hold a refreshed report already
    folder.write_text("a file where a folder should be")


def test_report_path_unwritable_at_exit_does_not_raise(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with (
        pytest.warns(gradwatch.GradWatchWarning, match="internal_error"),
        gradwatch.watch(model, opt, config={"report_path": str(folder / "report.json")}) as w,
    ):
        train(model, opt)
        _block(folder)
    (err,) = w.report().by_check("internal_error")
    assert err.details["where"] == "report writing"
    assert w.report().steps == STEPS


def test_report_path_unwritable_at_exit_does_not_hide_the_users_error(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    model = make_model()
    with (
        pytest.raises(KeyError, match="the user's own bug"),
        gradwatch.watch(model, config={"report_path": str(folder / "r.json")}),
    ):
        _block(folder)
        raise KeyError("the user's own bug")


def test_report_path_unwritable_at_exit_raises_when_strict(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    model = make_model()
    cfg = {"report_path": str(folder / "r.json"), "on_internal_error": "raise"}
    with pytest.raises(OSError), gradwatch.watch(model, config=cfg):
        _block(folder)


def test_sink_keeps_receiving_after_a_fault_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A faulty check does not take the metrics of the step with it."""
    sink = RecordingSink()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monkeypatch.setattr(GhostParam, "on_step", _boom)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}, sinks=[sink]) as w:
        train(model, opt)
    assert sink.logged == list(range(STEPS))
    assert sink.closed
    assert w.report().steps == STEPS


def test_a_pages_long_error_is_one_short_line_in_the_message_and_whole_in_details(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's dispatcher errors list every backend: the finding's message keeps one line."""
    text = "Could not run 'aten::ne.Scalar' with arguments\n" + "CPU: registered at x\n" * 200

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(text)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monkeypatch.setattr(GhostParam, "on_step", boom)
    with caplog.at_level(logging.WARNING, logger="gradwatch"), pytest.warns(GradWatchWarning):
        with gradwatch.watch(model, opt) as w:
            train(model, opt)
    (err,) = w.report().by_check("internal_error")
    assert "\n" not in err.message and len(err.message) < 300
    assert "NotImplementedError: Could not run 'aten::ne.Scalar'" in err.message
    assert err.details["error"].count("CPU: registered") == 200
    (logged,) = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert "\n" not in logged and len(logged) < 300


# -- atomic report writing -----------------------------------------------------------------


def _report(tmp_path: Path) -> tuple[gradwatch.Report, Path]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt) as w:
        train(model, opt)
    target = tmp_path / "report.json"
    w.report().write(target)
    return w.report(), target


def test_report_serialisation_error_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    report, target = _report(tmp_path)
    before = target.read_bytes()
    broken = report.model_copy(deep=True)
    broken.findings.append(
        gradwatch.Finding(check="x", severity="info", message="m", details={"obj": object()})
    )
    with pytest.raises(Exception, match="serializ"):
        broken.write(target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert gradwatch.Report.read(target) == report


def test_report_write_failing_midway_leaves_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, target = _report(tmp_path)
    before = target.read_bytes()
    real_fdopen = os.fdopen

    class HalfWriter:
        """Writes half of what it is given, then fails (a full disk)."""

        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def __enter__(self) -> HalfWriter:
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

        def write(self, text: str) -> int:
            self.fh.write(text[: len(text) // 2])
            self.fh.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(
        gradwatch.report_io.os, "fdopen", lambda *a, **k: HalfWriter(real_fdopen(*a, **k))
    )
    with pytest.raises(OSError, match="No space"):
        report.write(target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# -- places that used to swallow their faults (issue 51.3) ----------------------------------


def test_a_fault_while_locating_a_finding_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Locations.annotate`` swallowed every fault: a location is a nicety, but a fault is not."""
    import gradwatch.model.locations

    monkeypatch.setattr(gradwatch.model.locations, "defined_at", _boom)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    unused = nn.Linear(4, 4)
    model.add_module("unused", unused)  # a ghost: its finding is located
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(2):
            opt.zero_grad()
            model[1](model[0](torch.randn(4, 4))).sum().backward()
            opt.step()
    report = w.report()
    assert [f.check for f in report.findings].count("ghost_param") == 1  # the finding stays
    faults = report.by_check("internal_error")
    assert [f.details["where"] for f in faults] == ["finding locations"]


def test_a_fault_while_noting_a_train_call_is_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ``nn.Module.train`` wrapper swallowed every fault; the user's ``eval()`` still works."""
    import gradwatch.capture.forward.mode_calls

    monkeypatch.setattr(gradwatch.capture.forward.mode_calls, "call_site", _boom)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 4)).sum().backward()
            opt.step()
            model.eval()
            assert not model[1].training
            model.train()
    faults = w.report().by_check("internal_error")
    assert [f.details["where"] for f in faults] == ["mode calls"]
