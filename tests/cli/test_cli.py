"""The ``gradwatch`` command line: exit codes, one-line errors, JSON/JUnit outputs, Probe."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks import ALL_CHECKS
from gradwatch.cli.main import main
from gradwatch.cli.probe import Probe, ProbeError, loss_not_decreasing, resolve_config
from gradwatch.render.junit import check_ids, junit_xml

pytestmark = pytest.mark.floor  # the CLI's output goes through rich (.ci/floor)

ROOT = Path(__file__).resolve().parents[2]
GHOST = str(ROOT / "examples" / "ci_ghost.py") + ":build"
CLEAN = str(ROOT / "examples" / "ci_clean.py") + ":build"

HEADER = """\
import torch
from torch import nn
from torch.nn import functional as F
import gradwatch
from gradwatch.checks import ALL_CHECKS

def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)

def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
"""


def target(tmp_path: Path, body: str, name: str = "probe_target") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(body), encoding="utf-8")
    return path


def junit_cases(path: Path) -> tuple[ET.Element, dict[str, ET.Element]]:
    root = ET.parse(path).getroot()
    suites = root.findall("testsuite")
    assert root.tag == "testsuites" and len(suites) == 1
    suite = suites[0]
    assert suite.get("name") == "gradwatch"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert len(cases) == len(suite.findall("testcase")) == int(suite.get("tests"))
    return suite, cases


# -- check: the examples -------------------------------------------------------------------


def test_ghost_example_fails_naming_the_ghost_and_writes_json_and_junit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_xml = tmp_path / "r.json", tmp_path / "out" / "gw.xml"
    code = main(["check", GHOST, "--json", str(out_json), "--junit", str(out_xml)])
    stdout = capsys.readouterr().out
    assert code == 1
    assert "aux_head.weight" in stdout and "not_called" in stdout and "FAILED" in stdout

    report = gradwatch.Report.read(out_json)
    assert report.failed and report.steps == 3
    assert report.config.every_n_steps == 1  # CI cadence: statistics on every step
    (ghost,) = report.by_check("ghost_param")
    assert set(ghost.params) == {"aux_head.weight", "aux_head.bias"}
    assert ghost.details["cause"] == "not_called"
    assert [f.check for f in report.findings] == ["ghost_param"]

    suite, cases = junit_cases(out_xml)
    assert list(cases) == check_ids(report)
    assert "ghost_param" in cases and "nonfinite_grad" in cases and len(cases) == len(ALL_CHECKS)
    assert suite.get("failures") == "1"
    failure = cases["ghost_param"].find("failure")
    assert failure is not None and failure.get("type") == "ghost_param.error"
    assert "aux_head" in failure.get("message", "")
    assert "aux_head.weight" in failure.text and "cause: not_called" in failure.text
    assert "hint: Its module never ran" in failure.text
    assert all(c.find("failure") is None for n, c in cases.items() if n != "ghost_param")


def test_clean_example_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_xml = tmp_path / "gw.xml"
    assert main(["check", CLEAN, "--steps", "4", "--junit", str(out_xml)]) == 0
    assert "passed" in capsys.readouterr().out
    suite, cases = junit_cases(out_xml)
    assert suite.get("failures") == "0" and len(cases) == len(ALL_CHECKS)
    assert all(c.find("failure") is None for c in cases.values())


@pytest.mark.parametrize(
    "extra",
    [
        ["--ignore", "aux_head.*"],
        ["--ignore", "encoder.*", "aux_head.weight", "aux_head.bias"],
        ["--fail-on", "never"],
    ],
)
def test_allowlist_and_fail_on_make_the_ghost_pass(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", GHOST, *extra]) == 0
    capsys.readouterr()


def test_config_file_allowlists_and_keeps_its_own_cadence(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("ignore: ['aux_head.*']\nevery_n_steps: 5\n", encoding="utf-8")
    out = tmp_path / "r.json"
    assert main(["check", GHOST, "--config", str(cfg), "--json", str(out)]) == 0
    report = gradwatch.Report.read(out)
    assert report.config.every_n_steps == 5 and report.config.ignore == ["aux_head.*"]
    assert report.findings == []


def test_fail_fast_config_reports_instead_of_crashing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "gw.json"
    cfg.write_text('{"fail_fast": true}', encoding="utf-8")
    out = tmp_path / "r.json"
    assert main(["check", GHOST, "--config", str(cfg), "--json", str(out)]) == 1
    assert gradwatch.Report.read(out).by_check("ghost_param")
    assert "aux_head" in capsys.readouterr().out


# -- check: errors exit 2 with one line ---------------------------------------------------


BROKEN = {
    "missing_file": (None, "nope.py:build", "cannot import '{dir}/nope.py:build': No such file"),
    "no_colon": (None, "examples/ci_clean.py", "must be 'path/to/file.py:factory'"),
    "missing_attr": ("", "{path}:build", "has no attribute 'build'"),
    "import_raises": (
        "raise RuntimeError('boom at import')\n",
        "{path}:build",
        "RuntimeError: boom at import",
    ),
    "syntax_error": ("def build(:\n", "{path}:build", "SyntaxError"),
    "factory_raises": (
        "def build():\n    raise KeyError('dataset')\n",
        "{path}:build",
        "raised KeyError",
    ),
    "wrong_type": (
        "def build():\n    return nn.Linear(2, 2)\n",
        "{path}:build",
        "returned Linear, not a gradwatch.Probe",
    ),
    "not_callable": ("build = 3\n", "{path}:build", "is a int, not a factory"),
    "bad_probe_field": (
        "def build():\n    return gradwatch.Probe(model='net', batch=data(), loss_fn=mse)\n",
        "{path}:build",
        "Probe.model must be a torch.nn.Module",
    ),
    "loss_fn_fails": (
        "def build():\n    return gradwatch.Probe(nn.Linear(4, 1), data(), lambda m, b: m(b[0][:, :3]).sum())\n",
        "{path}:build",
        "loss_fn failed at step 0: RuntimeError",
    ),
    "loss_not_scalar": (
        "def build():\n    return gradwatch.Probe(nn.Linear(4, 1), data(), lambda m, b: m(b[0]))\n",
        "{path}:build",
        "not a scalar",
    ),
    "module_not_found": (
        None,
        "no_such_pkg_gw.mod:build",
        "ModuleNotFoundError: No module named 'no_such_pkg_gw'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_target_exits_2_with_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    body, spec, expected = BROKEN[case]
    path = target(tmp_path, body, name=f"t_{case}") if body is not None else None
    monkeypatch.chdir(tmp_path if body is None and "nope" in spec else ROOT)
    arg = spec.format(path=path, dir=".")
    if case == "missing_file":
        arg, expected = "./nope.py:build", "cannot import './nope.py:build': No such file"
    assert main(["check", arg]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gradwatch: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_verbose_adds_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = target(tmp_path, "def build():\n    raise KeyError('dataset')\n")
    assert main(["check", f"{path}:build", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradwatch: error: factory") and "Traceback" in err and "KeyError" in err


def test_bad_config_file_exits_2_naming_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("fail_on: sometimes\n", encoding="utf-8")
    assert main(["check", CLEAN, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fail_on" in err and "bad.yaml" in err


@pytest.mark.parametrize(
    "argv", [[], ["check"], ["check", CLEAN, "--steps", "0"], ["schema", "nope"]]
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err  # one line and a pointer to --help, no usage block (issue 31)
    assert err.startswith("gradwatch") and err.count("\n") == 1 and "usage:" not in err, err
    assert err.rstrip().endswith("--help'")


def test_module_target_and_probe_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pkg = tmp_path / "gw_pkg_cli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    target(pkg, "PROBE = gradwatch.Probe(nn.Linear(4, 1), data(), mse)\n", name="probes")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "gw_pkg_cli.probes:PROBE"]) == 0
    assert "passed" in capsys.readouterr().out


# -- check --overfit -----------------------------------------------------------------------


def test_overfit_passes_on_a_healthy_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_xml, out_json = tmp_path / "gw.xml", tmp_path / "r.json"
    assert (
        main(["check", CLEAN, "--overfit", "--junit", str(out_xml), "--json", str(out_json)]) == 0
    )
    assert "overfit: loss" in capsys.readouterr().out
    assert gradwatch.Report.read(out_json).findings == []
    _, cases = junit_cases(out_xml)
    assert "loss_not_decreasing" in cases and cases["loss_not_decreasing"].find("failure") is None


def test_overfit_flags_a_model_that_cannot_learn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lr=0: every gradient is fine, nothing ever moves, so one batch is never fitted.
    path = target(
        tmp_path,
        """
        def build():
            model = nn.Linear(4, 1)
            return gradwatch.Probe(model, data(), mse, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        """,
    )
    out_json, out_xml = tmp_path / "r.json", tmp_path / "gw.xml"
    argv = ["check", f"{path}:build", "--overfit", "--overfit-steps", "10", "--json", str(out_json)]
    # lr 0 on the whole model is also a stale_param error (severity by share, issue 31), and
    # the does_not_learn probe's (it overfits with the same optimizer): both off.
    argv += ["--ignore-check", "stale_param", "--no-probes"]
    assert main(argv) == 0  # a warning does not reach the default fail_on=error
    (finding,) = gradwatch.Report.read(out_json).by_check("loss_not_decreasing")
    assert finding.severity == "warning" and finding.details["steps"] == 10
    assert finding.details["final_loss"] == pytest.approx(finding.details["initial_loss"])
    assert main([*argv, "--fail-on", "warning", "--junit", str(out_xml)]) == 1
    _, cases = junit_cases(out_xml)
    assert cases["loss_not_decreasing"].find("failure") is not None
    capsys.readouterr()


def test_loss_not_decreasing_rule() -> None:
    assert loss_not_decreasing([2.0, 1.7]) is None
    assert loss_not_decreasing([2.0, 1.9]) is not None
    assert loss_not_decreasing([-1.0, -1.2]) is None  # negative losses fall too
    assert loss_not_decreasing([-1.0, -1.05]) is not None
    assert loss_not_decreasing([1.0, float("nan")]) is not None
    assert loss_not_decreasing([0.0, 0.0]) is None and loss_not_decreasing([1.0]) is None


# -- report and schema ---------------------------------------------------------------------


def test_report_command_reprints_and_keeps_the_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ghost_json, clean_json = tmp_path / "g.json", tmp_path / "c.json"
    main(["check", GHOST, "--json", str(ghost_json)])
    main(["check", CLEAN, "--json", str(clean_json)])
    capsys.readouterr()
    out_xml = tmp_path / "from_report.xml"
    assert main(["report", str(ghost_json), "--junit", str(out_xml)]) == 1
    assert "aux_head.weight" in capsys.readouterr().out
    _, cases = junit_cases(out_xml)
    assert cases["ghost_param"].find("failure") is not None
    assert main(["report", str(clean_json)]) == 0


@pytest.mark.parametrize("content", [None, "not json", '{"steps": 3}'])
def test_report_command_unreadable_exits_2(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gradwatch: error: cannot read report")


def test_report_command_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gradwatch.render.html")
    pytest.importorskip("matplotlib")
    src, html = tmp_path / "g.json", tmp_path / "out" / "r.html"
    main(["check", GHOST, "--json", str(src)])
    assert main(["report", str(src), "--html", str(html)]) == 1
    assert "aux_head" in html.read_text(encoding="utf-8")
    capsys.readouterr()


@pytest.mark.parametrize(
    ("which", "model"), [("config", gradwatch.GradWatchConfig), ("report", gradwatch.Report)]
)
def test_schema(which: str, model: type, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", which]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == model.model_json_schema()
    assert ("fail_on" in schema["properties"]) and ("findings" in schema["properties"]) == (
        which == "report"
    )


# -- JUnit details -------------------------------------------------------------------------


def test_junit_lists_extra_checks_keeps_quiet_findings_and_strips_bad_characters() -> None:
    cfg = gradwatch.GradWatchConfig(fail_on="error", checks={"dead_param": {"enabled": False}})
    report = gradwatch.Report(
        gradwatch_version=gradwatch.__version__,
        torch_version=torch.__version__,
        config=cfg,
        findings=[
            gradwatch.Finding(
                check="exploding_grad", severity="warning", message="big\x00norm", params=["w"]
            ),
            gradwatch.Finding(check="internal_error", severity="error", message="sink failed"),
        ],
    )
    root = ET.fromstring(junit_xml(report, extra_checks=["loss_not_decreasing"]))
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert "dead_param" not in cases
    assert list(cases)[-2:] == ["loss_not_decreasing", "internal_error"]
    assert cases["internal_error"].find("failure") is not None
    assert cases["exploding_grad"].find("failure") is None
    assert "big\\x00norm" in cases["exploding_grad"].find("system-out").text
    assert root.find("testsuite").get("failures") == "1"


# -- Probe ---------------------------------------------------------------------------------


def test_probe_defaults_and_batches() -> None:
    model = nn.Linear(4, 1)
    one = (torch.ones(2, 4), torch.zeros(2, 1))
    probe = Probe(model, one, lambda m, b: m(b[0]).pow(2).mean())
    assert isinstance(probe.optimizer, torch.optim.SGD) and probe.optimizer.defaults["lr"] == 1e-2
    assert [next(probe.batches()) is one for _ in range(2)] == [True, True]

    gen_probe = Probe(
        model, (torch.full((1, 4), float(k)) for k in range(3)), lambda m, b: m(b).sum()
    )
    it = gen_probe.batches()
    assert [int(next(it)[0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert int(gen_probe.first_batch()[0, 0]) == 0

    empty = Probe(model, iter([]), lambda m, b: m(b).sum())
    with pytest.raises(ProbeError, match="empty iterable"):
        empty.run(1)


def test_probe_rejects_bad_fields() -> None:
    with pytest.raises(ProbeError, match="loss_fn must be callable"):
        Probe(nn.Linear(2, 1), torch.ones(1, 2), "mse")  # type: ignore[arg-type]
    with pytest.raises(ProbeError, match="optimizer must be"):
        Probe(nn.Linear(2, 1), torch.ones(1, 2), lambda m, b: m(b).sum(), optimizer="sgd")  # type: ignore[arg-type]
    frozen = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ProbeError, match="no trainable parameters"):
        Probe(frozen, torch.ones(1, 2), lambda m, b: m(b).sum())


def test_resolve_config_only_fills_what_is_unset() -> None:
    assert resolve_config(None).every_n_steps == 1
    assert resolve_config({"every_n_steps": 4}).every_n_steps == 4
    cfg = resolve_config(
        {"ignore": ["a.*"], "warn": True}, ignore=["a.*", "b"], fail_on="info", warn=False
    )
    assert cfg.ignore == ["a.*", "b"] and cfg.fail_on == "info" and cfg.warn is True


# -- the real entry point ------------------------------------------------------------------


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "gw.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwatch",
            "check",
            "examples/ci_ghost.py:build",
            "--junit",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "aux_head.weight" in proc.stdout and "not_called" in proc.stdout
    assert "GradWatchWarning" not in proc.stderr  # the report is the output, not warnings
    _, cases = junit_cases(out)
    assert cases["ghost_param"].find("failure") is not None
