"""Outputs survive any input: surrogate names, NaN/Inf values (strict JSON), long names,
concurrent writers, and a baseline can never turn an unobserved run into a pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.internal_error import InternalError
from gradwatch.checks.not_observed import NotObserved
from gradwatch.render.html_plots import gradient_flow
from gradwatch.render.sarif import write_sarif
from gradwatch.report_io import write_text_atomic

SURROGATE = os.fsdecode(b"head_\xff")  # a ModuleDict keyed by a file name that is not UTF-8


class Named(nn.Module):
    """``body`` trains; the layer named ``ghost`` never runs (a ghost_param finding)."""

    def __init__(self, ghost: str) -> None:
        super().__init__()
        self.d = nn.ModuleDict({"body": nn.Linear(2, 1), ghost: nn.Linear(2, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d["body"](x)


def train(model: nn.Module, config: dict[str, object], steps: int = 2) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False, **config}) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 2)).sum().backward()
            opt.step()
    return w.report()


def test_a_surrogate_name_survives_every_output(tmp_path: Path) -> None:
    report = train(Named(SURROGATE), {"report_path": str(tmp_path / "exit.json")})
    assert [f.module for f in report.findings] == [f"d.{SURROGATE}"]
    for path in (tmp_path / "exit.json", report.write(tmp_path / "r.json")):
        back = gradwatch.Report.read(path)  # written, strict UTF-8, read back
        assert back.findings[0].module == "d.head_\\udcff"  # shown as its escape
    write_sarif(report, tmp_path / "r.sarif")
    assert "head_\\\\udcff" in (tmp_path / "r.sarif").read_text(encoding="utf-8")
    pytest.importorskip("matplotlib")
    report.to_html(tmp_path / "r.html")
    assert "head_\\udcff" in (tmp_path / "r.html").read_text(encoding="utf-8")
    # The console, into a real UTF-8 pipe (a terminal or a CI log).
    code = (
        "import sys; from gradwatch import Report; "
        f"Report.read({str(tmp_path / 'r.json')!r}).print(); Report.model_validate_json("
        f"open({str(tmp_path / 'r.json')!r}).read()).print(style='table')"
    )
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert b"head_\\udcff" in out.stdout


def test_a_surrogate_in_a_live_report_prints_and_serialises() -> None:
    report = train(Named(SURROGATE), {})
    text = report.summary()
    assert "head_\\udcff" in text
    text.encode("utf-8")  # nothing left that no UTF-8 output can encode
    gradwatch.Report.model_validate_json(report.model_dump_json())


def _strict(text: str) -> object:
    def refuse(const: str) -> object:
        raise ValueError(f"non-standard JSON literal {const}")

    return json.loads(text, parse_constant=refuse)


def test_json_report_is_strict_and_reads_both_forms(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        opt.zero_grad()
        model(torch.full((2, 2), float("inf"))).sum().backward()  # NaN/Inf gradients
        opt.step()
    report = w.report()
    assert report.failed
    text = report.model_dump_json(indent=2)
    data = _strict(text)  # jq, JSON.parse, Go: no NaN/Infinity literals
    assert "NaN" in text or "Infinity" in text
    back = gradwatch.Report.model_validate_json(text)
    assert back.failed and [f.check for f in back.findings] == [f.check for f in report.findings]
    # A report written with the literals (gradwatch before this change) still loads.
    assert isinstance(data, dict)
    data["layers"][0]["grad_norm_last"] = "NaN"
    data["findings"][0]["details"]["norm"] = "-Infinity"
    legacy = json.dumps(data).replace('"NaN"', "NaN").replace('"-Infinity"', "-Infinity")
    assert "NaN" in legacy and '"NaN"' not in legacy
    old = gradwatch.Report.model_validate_json(legacy)
    assert old.layers[0].grad_norm_last != old.layers[0].grad_norm_last  # NaN
    assert old.findings[0].details["norm"] == float("-inf")
    again = gradwatch.Report.model_validate_json(old.model_dump_json())
    assert again.findings[0].details["norm"] == float("-inf")  # a float, not a string


def test_with_baseline_never_accepts_not_observed() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        pass  # nothing ran
    new = w.report()
    assert new.failed and new.by_check(NotObserved.id)
    accepted = new.with_baseline(new.model_copy(deep=True))
    assert accepted.failed
    assert not any(f.baselined() for f in accepted.by_check(NotObserved.id))


def test_chart_labels_of_long_names_are_bounded() -> None:
    pytest.importorskip("matplotlib")
    long = "x" * 20_000  # to_html took 17-49 s for four such names
    report = train(Named(long), {})
    fig = gradient_flow(report)
    assert fig is not None
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]  # one row a layer
    assert labels and max(len(t) for t in labels) <= 60


def test_concurrent_writers_to_one_path(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    errors: list[BaseException] = []

    def write(path: Path) -> None:
        for _ in range(150):
            try:
                write_text_atomic(path, "{}" * 500)
            except BaseException as exc:  # counted, reported below
                errors.append(exc)

    for path in (target, link):
        threads = [threading.Thread(target=write, args=(path,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert target.read_text() == "{}" * 500 and link.is_symlink()


def test_csv_sink_takes_a_surrogate_name(tmp_path: Path) -> None:
    from gradwatch.sinks.csv import CSVSink

    model = nn.ModuleDict({SURROGATE: nn.Linear(2, 1)})
    model.forward = lambda x: model[SURROGATE](x)  # type: ignore[method-assign]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = CSVSink(tmp_path / "m.csv")
    config = {"warn": False, "every_n_steps": 1}
    with gradwatch.watch(model, opt, sinks=[sink], config=config) as w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 2)).sum().backward()
            opt.step()
    assert not w.report().by_check(InternalError.id)
    assert "head_\\udcff" in (tmp_path / "m.csv").read_text(encoding="utf-8")
