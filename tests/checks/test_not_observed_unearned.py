"""``not_observed``: passes that were not earned (another instance trained, everything ignored)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import gradwatch
from gradwatch.checks.not_observed import ALL_IGNORED, NotObserved


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))


def run(model: nn.Module, trained: nn.Module, config: dict[str, object]) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False, **config}) as w:
        for _ in range(3):
            opt.zero_grad()
            trained(torch.randn(4, 2)).sum().backward()
            opt.step()
    return w.report()


def test_a_deepcopy_trained_with_the_watched_optimizer_fails() -> None:
    model = net()
    report = run(model, copy.deepcopy(model), {})
    assert report.failed
    [finding] = report.findings
    assert finding.check == NotObserved.id and finding.details["reason"] == "never_ran"
    assert "another instance" in finding.message


def test_the_watched_model_itself_still_passes() -> None:
    model = net()
    report = run(model, model, {})
    assert not report.failed and not report.by_check(NotObserved.id)
    assert report.verdict() == "passed"


def test_ignore_everything_is_not_a_plain_pass() -> None:
    model = net()
    report = run(model, model, {"ignore": ["*"]})
    [finding] = report.by_check(NotObserved.id)
    assert finding.severity == "info" and finding.details["reason"] == ALL_IGNORED
    assert finding.details["ignored"] == 4
    assert report.verdict() == "NOT JUDGED (4 parameters ignored)"
    assert "NOT JUDGED (4 parameters ignored)" in report.summary()
    assert "passed" not in report.summary(style="table")


def test_ignore_of_some_parameters_judges_the_others() -> None:
    model = net()
    report = run(model, model, {"ignore": ["0.*"]})
    assert not report.by_check(NotObserved.id) and report.verdict() == "passed"


def test_the_optimizer_of_a_copy_watched_with_the_original_fails() -> None:
    model = net()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(3):
            opt.zero_grad()
            twin(torch.randn(4, 2)).sum().backward()
            opt.step()
    report = w.report()
    assert report.failed
    assert [f.details["reason"] for f in report.by_check(NotObserved.id)] == ["never_ran"]
