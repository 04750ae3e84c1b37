"""The pytest plugin, run on real inner test suites with ``pytester``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gradwatch
from gradwatch.pytest_plugin import report_filename

pytestmark = pytest.mark.floor  # the plugin on the pytest floor (.ci/floor)

MODELS = """
import pytest
import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self, ghost: bool) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        if ghost:
            self.aux = nn.Linear(8, 2)  # never called in forward

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def train(model, opt, steps=3):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An in-process inner run (hypothesis's plugin off: re-importing it each run costs seconds)."""
    return pytester.runpytest("-p", "no:hypothesispytest", "-p", "no:cacheprovider", *args)


@pytest.fixture(autouse=True, scope="module")
def _torch_imported_outside_pytester() -> None:
    """Run one watched optimizer step here first.

    The first ``optimizer.step()`` of a process imports ~800 torch modules lazily (dynamo,
    inductor). Inside an in-process pytester run they would be dropped from ``sys.modules``
    at its end, and the next run would register ``torch._inductor.test_operators``'s
    TORCH_LIBRARY a second time and crash.
    """
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(gw_models=MODELS)
    pytester.makepyfile(
        test_inner="""
        from gw_models import Net, train, sgd

        def test_ghost(gradwatch):
            model = Net(ghost=True)
            opt = sgd(model)
            gradwatch(model, opt)
            train(model, opt)

        def test_clean(gradwatch):
            model = Net(ghost=False)
            opt = sgd(model)
            w = gradwatch(model, opt)
            train(model, opt)
            assert w.report().steps == 3

        def test_ghost_allowlisted(gradwatch):
            model = Net(ghost=True)
            opt = sgd(model)
            gradwatch(model, opt, config={"ignore": ["aux.*"]})
            train(model, opt)
        """
    )
    return pytester


def test_ghost_fails_clean_and_allowlisted_pass(suite: pytest.Pytester) -> None:
    result = run(suite)
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "FAILED test_inner.py::test_ghost" in out
    result.stdout.fnmatch_lines(
        [
            "*gradwatch: 1 finding(s) at or above fail_on='error':",
            "*- ghost_param: [[]error[]] 2 parameters of 'aux' got no gradient*(cause: not_called).",
            "*parameters: aux.weight, aux.bias",
            "*cause: not_called",
            "*hint: Its module never ran*",
        ]
    )
    assert "Traceback" not in out  # pytest.fail(pytrace=False): the findings, not our frames


def test_allowlist_through_config_file_and_fail_on_option(suite: pytest.Pytester) -> None:
    suite.makefile(".yaml", gw="ignore: ['aux.*']\n")
    run(suite, "--gradwatch-config", "gw.yaml").assert_outcomes(passed=3)
    run(suite, "--gradwatch-fail-on", "never").assert_outcomes(passed=3)


def test_config_file_and_test_config_merge(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(gw_models=MODELS)
    pytester.makefile(".yaml", gw="ignore: ['body.*']\nfail_on: warning\n")
    pytester.makepyfile(
        test_merge="""
        from gw_models import Net, train, sgd

        def test_merged(gradwatch):
            model = Net(ghost=True)
            opt = sgd(model)
            w = gradwatch(model, opt, config={"ignore": ["aux.*"], "every_n_steps": 2})
            assert w.config.ignore == ["body.*", "aux.*"]
            assert w.config.fail_on == "warning" and w.config.every_n_steps == 2
            assert w.config.warn is False
            train(model, opt)
        """
    )
    run(pytester, "--gradwatch-config", "gw.yaml").assert_outcomes(passed=1)


def test_bad_config_file_is_a_usage_error(suite: pytest.Pytester) -> None:
    suite.makefile(".yaml", bad="fail_on: sometimes\n")
    result = run(suite, "--gradwatch-config", "bad.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gradwatch-config: bad.yaml: fail_on*"])


def test_report_dir_gets_one_report_per_test(suite: pytest.Pytester) -> None:
    out = suite.path / "reports"
    run(suite, "--gradwatch-report-dir", str(out)).assert_outcomes(passed=2, failed=1)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        report_filename(f"test_inner.py::{t}")
        for t in ("test_ghost", "test_clean", "test_ghost_allowlisted")
    )
    ghost = gradwatch.Report.read(out / report_filename("test_inner.py::test_ghost"))
    assert ghost.failed and ghost.by_check("ghost_param")[0].params == ["aux.weight", "aux.bias"]
    clean = json.loads((out / report_filename("test_inner.py::test_clean")).read_text())
    assert clean["failed"] is False and clean["steps"] == 3


def test_several_watchers_a_failing_body_and_xfail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(gw_models=MODELS)
    pytester.makepyfile(
        test_more="""
        import pytest
        from gw_models import Net, train, sgd

        def test_two_watchers(gradwatch):
            for ghost in (False, True):
                model = Net(ghost=ghost)
                opt = sgd(model)
                gradwatch(model, opt)
                train(model, opt)

        def test_body_fails_first(gradwatch):
            model = Net(ghost=True)
            opt = sgd(model)
            gradwatch(model, opt)
            train(model, opt)
            assert 1 == 2, "the test's own failure"

        @pytest.mark.xfail(strict=True, reason="known ghost")
        def test_known_ghost(gradwatch):
            model = Net(ghost=True)
            opt = sgd(model)
            gradwatch(model, opt)
            train(model, opt)

        def test_hooks_gone_after_test(gradwatch):
            model = Net(ghost=False)
            opt = sgd(model)
            w = gradwatch(model, opt)
            assert model.body._forward_hooks
            train(model, opt)
            w.close()
            assert not model.body._forward_hooks
        """
    )
    out = pytester.path / "reports"
    result = run(pytester, "--gradwatch-report-dir", str(out))
    result.assert_outcomes(failed=2, xfailed=1, passed=1)
    text = result.stdout.str()
    assert "gradwatch (watcher 2 of 2): 1 finding(s)" in text
    assert "watcher 1 of 2" not in text  # the clean watcher is not blamed
    assert "the test's own failure" in text
    assert (out / "test_more.py__test_two_watchers.json").exists()
    assert (out / "test_more.py__test_two_watchers-2.json").exists()
    assert gradwatch.Report.read(out / "test_more.py__test_body_fails_first.json").failed


def test_report_filename_is_safe_and_bounded() -> None:
    assert report_filename("a/b.py::C::t[x y/1]").startswith("a_b.py__C__t_x_y_1-")
    assert report_filename("t.py::t", 2) == "t.py__t-3.json"
    long = report_filename("t.py::t[" + "x" * 300 + "]")
    assert len(long) < 130 and long != report_filename("t.py::t[" + "x" * 299 + "]")
    assert "/" not in report_filename("../../etc/passwd") and not report_filename("..").startswith(
        "."
    )


def test_report_dir_keeps_reports_of_ids_that_sanitise_alike(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(gw_models=MODELS)
    pytester.makepyfile(
        test_ids="""
        import pytest
        from gw_models import Net, train, sgd

        @pytest.mark.parametrize("ghost", [True, False], ids=["a/b", "a_b"])
        def test_p(gradwatch, ghost):
            model = Net(ghost=ghost)
            opt = sgd(model)
            gradwatch(model, opt)
            train(model, opt)
        """
    )
    out = pytester.path / "reports"
    run(pytester, "--gradwatch-report-dir", str(out)).assert_outcomes(passed=1, failed=1)
    failing = gradwatch.Report.read(out / report_filename("test_ids.py::test_p[a/b]"))
    passing = gradwatch.Report.read(out / report_filename("test_ids.py::test_p[a_b]"))
    assert failing.failed and not passing.failed
    assert len(list(out.iterdir())) == 2


def test_report_filenames_of_ids_that_sanitise_alike_differ() -> None:
    ids = ["t.py::test_p[a/b]", "t.py::test_p[a_b]", "t.py::test_p_a_b_", "a/b.py::t", "a_b.py::t"]
    assert len({report_filename(i) for i in ids}) == len(ids)


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("gradwatch")
    assert plugin is not None and Path(plugin.__file__).name == "pytest_plugin.py"
