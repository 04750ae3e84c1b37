"""Ways of using a watcher that left a passing report although nothing was checked (issue 44.2).

Each loop here has a real bug or a run gradwatch did not see; the report must never pass.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from _loops import SideNet, batches, mlp
from torch import nn

import gradwatch
from gradwatch.errors import ConfigError, GradWatchError


def _reasons(report: gradwatch.Report) -> list[str]:
    return [f.details.get("reason", "") for f in report.by_check("not_observed")]


# -- watch() without ``with`` --------------------------------------------------------------


def test_a_watcher_never_entered_is_no_pass() -> None:
    model = SideNet(use_side=False)  # a ghost the watcher would have found
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = gradwatch.watch(model, opt)
    for x, y in batches(4, out=4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    report = w.report()
    assert report.failed and _reasons(report) == ["never_entered"]
    assert "with gradwatch.watch" in report.by_check("not_observed")[0].hint
    with pytest.raises(GradWatchError, match="never entered"):
        report.raise_for_findings()
    assert len(w.report().by_check("not_observed")) == 1  # asked twice, said once


def test_a_watcher_closed_without_entering_is_no_pass() -> None:
    model = mlp()
    w = gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    w.close()
    assert _reasons(w.report()) == ["never_entered"]


def test_an_entered_watcher_does_not_say_never_entered() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = gradwatch.watch(model, opt)
    w.attach()
    for x, y in batches(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    w.close()
    assert not w.report().failed


# -- parameters replaced mid-run ------------------------------------------------------------


def _reinit(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(torch.randn_like(module.weight) * 0.1)
        module.bias = nn.Parameter(torch.zeros_like(module.bias))


def _reinit_run(add: bool) -> gradwatch.Report:
    """Three steps, then new parameters and a new optimizer; zero_grad stops after step 5."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for i, (x, y) in enumerate(batches(8)):
            if i == 3:
                model.apply(_reinit)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                if add:
                    w.add_optimizer(opt)
            if i < 5:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def test_parameters_replaced_by_unwatched_ones_are_no_pass() -> None:
    report = _reinit_run(add=False)
    assert report.failed and "params_replaced" in _reasons(report)
    found = report.by_check("not_observed")[0]
    assert set(found.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "add_optimizer" in found.hint


def test_the_new_optimizer_added_is_watched_and_its_missing_zero_grad_found() -> None:
    report = _reinit_run(add=True)
    assert "params_replaced" not in _reasons(report)
    assert report.by_check("missing_zero_grad")


def test_parameters_reset_in_place_are_not_replaced() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for i, (x, y) in enumerate(batches(4)):
            if i == 2:
                for m in model.modules():
                    if isinstance(m, nn.Linear):
                        m.reset_parameters()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert not w.report().failed


# -- two live watchers, one report file -----------------------------------------------------


def test_two_live_watchers_cannot_share_a_report_path(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    a, b = mlp(), mlp()
    with gradwatch.watch(a, config={"report_path": str(path)}):
        with pytest.raises(ConfigError, match="another live watcher"):
            gradwatch.watch(b, config={"report_path": str(tmp_path / "." / "report.json")}).attach()
        # b's failed start released b: it can be watched, with a report of its own
        with gradwatch.watch(b, config={"report_path": str(tmp_path / "b.json")}):
            b(torch.randn(2, 8)).sum().backward()
        a(torch.randn(2, 8)).sum().backward()
    assert json.loads(path.read_text())["backward_passes"] == 1


def test_two_watchers_created_before_either_enters_cannot_share_a_report_path(
    tmp_path: Path,
) -> None:
    """Two models trained in two threads from one YAML: the second watcher is refused at once.

    Were both accepted, whichever closed last would write the file: the clean run's
    "passed" would replace the failed run's report.
    """
    cfg = {"report_path": str(tmp_path / "report.json")}
    first = gradwatch.watch(SideNet(use_side=False), config=cfg)
    with pytest.raises(ConfigError, match="another live watcher"):
        gradwatch.watch(mlp(), config=cfg)
    first.close()  # never entered: it writes nothing and gives the file up
    made: list[object] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def make() -> None:
        start.wait()
        try:
            made.append(gradwatch.watch(mlp(), config=cfg))
        except ConfigError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(made), len(errors)) == (1, 3)  # one claim, whichever thread was first
    made.clear()  # the one made is dropped unclosed: its claim goes with it
    model = mlp()
    with gradwatch.watch(model, config=cfg):
        model(torch.randn(2, 8)).sum().backward()
    assert json.loads((tmp_path / "report.json").read_text())["backward_passes"] == 1


def test_a_failed_runs_report_is_not_overwritten_by_a_passing_one(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    ghosted, clean = SideNet(use_side=False), mlp(out=4)
    failed = gradwatch.watch(ghosted, config={"report_path": str(path)})
    with failed:
        with pytest.raises(ConfigError):
            gradwatch.watch(clean, config={"report_path": str(path)}).attach()
        for x, y in batches(2, out=4):
            nn.functional.mse_loss(ghosted(x), y).backward()
    assert json.loads(path.read_text())["failed"] is True
    # the file is free again once its watcher exited
    with gradwatch.watch(clean, config={"report_path": str(path)}):
        pass


# -- a parameter that refuses hooks at enter ------------------------------------------------


class NoHooks(nn.Parameter):
    """A parameter type whose tensor hooks cannot be registered (as some subclasses do)."""

    def register_post_accumulate_grad_hook(self, hook: object) -> None:  # type: ignore[override]
        raise RuntimeError("this parameter type takes no hooks")

    def register_hook(self, hook: object) -> None:  # type: ignore[override]
        raise RuntimeError("this parameter type takes no hooks")


def test_a_parameter_refusing_hooks_at_enter_is_contained() -> None:
    head = nn.Linear(8, 1)
    head.weight = NoHooks(head.weight.detach().clone())
    model = nn.Sequential(nn.Linear(4, 8), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:  # no RuntimeError out of __enter__
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
    report = w.report()
    assert "attach" in {f.details.get("where") for f in report.by_check("internal_error")}
    assert not model[0].weight._post_accumulate_grad_hooks  # removed at exit all the same
    assert not model[0].weight._backward_hooks


# -- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sinks", "said"),
    [
        ("tensorboard", "sinks must be a list of sink objects, not str"),
        ([object()], r"sinks\[0\] \(object\) has no log_metrics"),
        (42, "not int"),
    ],
)
def test_sinks_that_are_no_sinks_are_refused_at_watch(sinks: object, said: str) -> None:
    model = mlp()
    with pytest.raises(ConfigError, match=said) as info:
        gradwatch.watch(model, sinks=sinks)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_report_path_name_too_long_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 300 + ".json")
    with pytest.raises(ConfigError, match="report_path") as info:
        with gradwatch.watch(mlp(), config={"report_path": str(path)}):
            pass
    assert "\n" not in str(info.value)
