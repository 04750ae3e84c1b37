"""Probes where users meet them: ``gradwatch.probe``, ``Watcher.probe``, ``gradwatch check`` (on by
default, ``--no-probes``) and the pytest fixture (``batch=``/``loss_fn=``, ``--gradwatch-no-probes``)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _probe_models import ce, data, mlp
from torch import nn

import gradwatch
from gradwatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_global_rng_state_is_restored() -> None:
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 10))
    batch = data()
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    gradwatch.probe(model, batch, ce)
    assert torch.equal(before[0], torch.get_rng_state())
    assert before[1] == random.getstate()
    assert (before[2] == np.random.get_state()[1]).all()


def test_the_report_round_trips_with_its_probes_section() -> None:
    model = mlp()
    report = gradwatch.probe(model, data(), ce, torch.optim.Adam(model.parameters(), lr=1e-3))
    again = gradwatch.Report.model_validate_json(report.model_dump_json())
    assert [p.id for p in again.probes] == [
        "sample_dependence",
        "gradient_mismatch",
        "does_not_learn",
        "forward_not_reproducible",
        "batch_order_dependent",
        "dependence_outside_receptive_field",
        "update_ascends_loss",
        "sample_weight_depends_on_split",
    ]
    assert again.probes[1].layers and again.probes[2].curve
    assert all(p.seconds > 0 for p in again.probes) and again.probes[1].memory_bytes > 0
    old = report.model_dump(exclude={"probes"})  # a report written before probes still loads
    assert gradwatch.Report.model_validate(old).probes == []


def test_a_disabled_probe_does_not_run() -> None:
    cfg = {"checks": {"does_not_learn": {"enabled": False}}}
    report = gradwatch.probe(mlp(), data(), ce, config=cfg)
    assert "does_not_learn" not in [p.id for p in report.probes]
    assert [p.id for p in report.probes][:2] == ["sample_dependence", "gradient_mismatch"]


def test_watcher_probe_leaves_the_watched_run_alone() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = data()
    with gradwatch.watch(model, opt, config={"probes": "off"}) as w:  # w.probe is the subject
        for _ in range(2):
            opt.zero_grad()
            ce(model, batch).backward()
            opt.step()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        probed = w.probe(batch, ce)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        for _ in range(2):
            opt.zero_grad()
            ce(model, batch).backward()
            opt.step()
    # an MLP has no position axis: the receptive-field property is not judged (said)
    assert [p.verdict for p in probed.probes] == ["passed"] * 5 + ["not_observed"] + ["passed"] * 2
    report = w.report()
    assert (report.steps, report.backward_passes) == (4, 4) and not report.findings


TARGET = """
import torch
from torch import nn
import torch.nn.functional as F
import gradwatch


class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(Swish.apply(self.a(x)))


def build():
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
    return gradwatch.Probe(model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), config=CONFIG)


CONFIG = None
"""


def test_gradwatch_check_runs_the_probes_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "swish_target.py"
    target.write_text(TARGET, encoding="utf-8")
    out = tmp_path / "report.json"
    # gradient_mismatch is preview (SPEC 8.1): found, at info, failing nothing by default
    assert main(["check", f"{target}:build", "--json", str(out)]) == 0
    (found,) = gradwatch.Report.read(out).by_check("gradient_mismatch")
    assert found.severity == "info" and found.details["preview_severity"] == "error"
    target.write_text(TARGET.replace("CONFIG = None", "CONFIG = {'preview': True}"), "utf-8")
    assert main(["check", f"{target}:build", "--json", str(out)]) == 1
    report = gradwatch.Report.read(out)
    assert [f.check for f in report.failing()] == ["gradient_mismatch"]
    assert {p.id: p.verdict for p in report.probes}["gradient_mismatch"] == "finding"
    assert main(["check", f"{target}:build", "--no-probes", "--json", str(out)]) == 0
    assert gradwatch.Report.read(out).probes == []
    capsys.readouterr()


SUITE = """
import torch
import torch.nn.functional as F
from torch import nn


class Leaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.softmax(self.a(x), dim=0))


def test_leak(gradwatch):
    model = Leaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1])
    gradwatch(model, opt, batch=(x, y), loss_fn=loss_fn)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(model, (x, y)).backward()
        opt.step()
"""


@pytest.fixture(scope="module")
def _stepped_outside_pytester() -> None:
    """One optimizer step first: the lazy torch imports it makes must not happen inside an
    in-process pytester run (see tests/cli/test_pytest_plugin.py)."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


@pytest.mark.usefixtures("_stepped_outside_pytester")
@pytest.mark.parametrize("skip", [False, True])
def test_the_pytest_fixture_runs_the_probes_unless_told_not_to(
    pytester: pytest.Pytester, skip: bool
) -> None:
    pytester.makepyfile(test_inner=SUITE)
    args = ["-p", "no:hypothesispytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    result = pytester.runpytest(*args, *(["--gradwatch-no-probes"] if skip else []))
    if skip:
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*probes, on a copy of the model*", "*sample_dependence*"])


def test_the_html_report_shows_the_overfit_curve_and_the_agreement(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = mlp()
    report = gradwatch.probe(model, data(), ce, torch.optim.Adam(model.parameters(), lr=1e-2))
    page = report.to_html(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Probes (on a copy of the model)" in page
    assert 'alt="Overfit one batch"' in page and 'alt="Derivative agreement"' in page
    assert gradwatch.Report(**report.model_dump(exclude={"probes"})).probes == []
