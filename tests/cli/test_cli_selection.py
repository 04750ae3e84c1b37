"""``check --select`` / ``--ignore-check`` / ``--update-baseline``, one-line usage errors, and
output paths refused before the probe runs; all through ``python -m gradwatch`` (issue 31)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradwatch
from gradwatch.checks.registry import ALL_CHECKS, SELF_CHECKS
from gradwatch.cli.main import main
from gradwatch.render.junit import check_ids

ROOT = Path(__file__).resolve().parents[2]
GHOST_ID, STALE_ID = "ghost_param", "stale_param"
SELF_ID = SELF_CHECKS[0].id

# A ghost head (``aux_head`` never runs) with a long name, and a factory that leaves a mark:
# a test can tell whether the probe ever started.
TARGET = """\
import pathlib
import torch
from torch import nn
from torch.nn import functional as F
import gradwatch

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.aux_head = nn.Linear(8, 2)
        self.transformer_block_attention_output_projection = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])

def build():
    pathlib.Path(__file__).with_name("probe_ran").touch()
    torch.manual_seed(0)
    return gradwatch.Probe(Net(), (torch.randn(16, 4), torch.randn(16, 1)), mse)
"""
LONG_NAME = "transformer_block_attention_output_projection.weight"
GHOSTS = {
    "aux_head.weight",
    "aux_head.bias",
    "transformer_block_attention_output_projection.weight",
    "transformer_block_attention_output_projection.bias",
}


def gradwatch_cli(
    *args: str, cwd: Path, columns: int = 100, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradwatch", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": str(columns), "NO_COLOR": "1"},
    )


@pytest.fixture
def spec(tmp_path: Path) -> str:
    path = tmp_path / "probe_target.py"
    path.write_text(TARGET, encoding="utf-8")
    return f"{path}:build"


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


def enabled_checks(report: gradwatch.Report) -> set[str]:
    checks = report.config.checks
    return {k for k in type(checks).model_fields if getattr(checks, k).enabled}


# -- --select / --ignore-check ---------------------------------------------------------------


def test_select_runs_and_reports_only_those_checks(tmp_path: Path, spec: str) -> None:
    out, xml = tmp_path / "r.json", tmp_path / "r.xml"
    proc = gradwatch_cli(
        "check", spec, "--select", f"{STALE_ID}", "--json", str(out), "--junit", str(xml),
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the ghosts are not judged
    report = gradwatch.Report.read(out)
    assert enabled_checks(report) == {STALE_ID} and report.findings == []
    assert check_ids(report) == [STALE_ID]
    assert xml.read_text(encoding="utf-8").count("<testcase ") == 1

    proc = gradwatch_cli(
        "check", spec, "--select", f"{GHOST_ID},{STALE_ID}", "--select", "dead_param",
        "--ignore-check", STALE_ID, "--json", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = gradwatch.Report.read(out)
    assert enabled_checks(report) == {GHOST_ID, "dead_param"}  # an id in both is off
    assert {f.check for f in report.findings} == {GHOST_ID}
    assert {p for f in report.findings for p in f.params} == GHOSTS


def test_ignore_check_turns_off_only_those(tmp_path: Path, spec: str) -> None:
    out = tmp_path / "r.json"
    proc = gradwatch_cli(
        "check", spec, "--ignore-check", GHOST_ID, "--json", str(out), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = gradwatch.Report.read(out)
    assert enabled_checks(report) == {c.id for c in ALL_CHECKS} - {GHOST_ID}
    assert not report.by_check(GHOST_ID)


def test_the_command_line_wins_over_the_config_file(tmp_path: Path, spec: str) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"checks:\n  {GHOST_ID}: {{enabled: false}}\n  {STALE_ID}: {{severity: error}}\n",
        encoding="utf-8",
    )
    out = tmp_path / "r.json"
    # The config turns the ghost check off; --select turns it back on (its settings kept).
    args = ["check", spec, "--config", str(cfg), "--json", str(out)]
    proc = gradwatch_cli(*args, "--select", f"{GHOST_ID},{STALE_ID}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = gradwatch.Report.read(out)
    assert enabled_checks(report) == {GHOST_ID, STALE_ID}
    assert report.config.check(STALE_ID).severity == "error"  # the config's, untouched
    assert report.by_check(GHOST_ID)
    # Without --select the config's flag holds.
    assert gradwatch_cli(*args, cwd=tmp_path).returncode == 0


def test_unknown_id_is_one_line_naming_it_with_close_matches(tmp_path: Path, spec: str) -> None:
    line = one_error_line(gradwatch_cli("check", spec, "--select", "ghost_params", cwd=tmp_path))
    assert line.startswith("gradwatch check: error: argument --select: ")
    assert "unknown check id 'ghost_params' (did you mean ghost_param?)" in line
    assert line.endswith("see 'gradwatch check --help'")
    assert not (tmp_path / "probe_ran").exists()  # refused before the probe started


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--select", "nonfinite"], "'nonfinite' (did you mean nonfinite_grad, nonfinite_param?)"),
        (["--ignore-check", f"{GHOST_ID},zzz"], "unknown check id 'zzz' ('gradwatch explain'"),
        (["--select", ","], "expected check ids separated by commas"),
        (["--ignore-check", SELF_ID], f"'{SELF_ID}' is one of gradwatch's own checks"),
    ],
)
def test_bad_check_ids_are_usage_errors(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "unused.py:build", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "usage:" not in err, err


def test_selecting_a_self_check_is_allowed_and_it_stays_on(tmp_path: Path, spec: str) -> None:
    out = tmp_path / "r.json"
    proc = gradwatch_cli("check", spec, "--select", SELF_ID, "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert enabled_checks(gradwatch.Report.read(out)) == set()  # no configurable check runs


def test_overfit_is_skipped_when_its_check_is_not_selected(tmp_path: Path, spec: str) -> None:
    xml = tmp_path / "r.xml"
    proc = gradwatch_cli(
        "check", spec, "--overfit", "--select", GHOST_ID, "--junit", str(xml), cwd=tmp_path
    )
    assert proc.returncode == 1 and "overfit:" not in proc.stdout, proc.stdout + proc.stderr
    assert "loss_not_decreasing" not in xml.read_text(encoding="utf-8")


# -- --update-baseline -------------------------------------------------------------------------


def test_update_baseline_writes_the_baseline_and_exits_0(tmp_path: Path, spec: str) -> None:
    baseline = tmp_path / "ci" / "baseline.json"
    proc = gradwatch_cli("check", spec, "--update-baseline", str(baseline), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # findings, yet not a failing run
    saved = gradwatch.Report.read(baseline)
    n = len(saved.findings)
    assert f"baseline: wrote {n} finding{'' if n == 1 else 's'} to {baseline}" in proc.stdout
    loud = [f for f in saved.findings if f.severity != "info"]  # (a probe that could not judge)
    assert {f.check for f in loud} == {GHOST_ID}
    assert {p for f in loud for p in f.params} == GHOSTS
    assert not any(f.baselined() for f in saved.findings)

    # The baseline accepts what it holds; a new finding (another check) still fails.
    assert gradwatch_cli("check", spec, "--baseline", str(baseline), cwd=tmp_path).returncode == 0
    strict = gradwatch_cli(
        "check", spec, "--baseline", str(baseline), "--overfit", "--overfit-steps", "2",
        "--fail-on", "warning", cwd=tmp_path,
    )  # fmt: skip
    assert strict.returncode == 1 and "loss_not_decreasing" in strict.stdout, strict.stdout

    # Reading and rewriting one file in one run: the old one is read before the probe.
    again = gradwatch_cli(
        "check", spec, "--baseline", str(baseline), "--update-baseline", str(baseline),
        cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    again_saved = gradwatch.Report.read(baseline).findings
    assert {f.check for f in again_saved if f.severity != "info"} == {GHOST_ID}


def test_update_baseline_errors_still_exit_2(tmp_path: Path, spec: str) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("def build():\n    raise KeyError('dataset')\n", encoding="utf-8")
    baseline = tmp_path / "baseline.json"
    proc = gradwatch_cli("check", f"{bad}:build", "--update-baseline", str(baseline), cwd=tmp_path)
    assert "raised KeyError" in one_error_line(proc)
    assert not baseline.exists()


# -- output paths: refused before the probe runs ----------------------------------------------


@pytest.mark.parametrize(
    ("option", "what"),
    [
        ("--json", "JSON report (--json)"),
        ("--junit", "JUnit XML (--junit)"),
        ("--sarif", "SARIF (--sarif)"),
        ("--update-baseline", "baseline (--update-baseline)"),
    ],
)
def test_an_unwritable_output_is_refused_before_the_probe(
    option: str, what: str, tmp_path: Path, spec: str
) -> None:
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("", encoding="utf-8")
    path = blocker / "out" / "report.file"
    line = one_error_line(gradwatch_cli("check", spec, option, str(path), cwd=tmp_path))
    assert line.startswith(f"gradwatch: error: cannot write {what} '{path}'"), line
    assert not (tmp_path / "probe_ran").exists()


def test_output_folders_and_clashes_are_refused_before_the_probe(
    tmp_path: Path, spec: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check", spec, "--json", str(tmp_path)]) == 2
    assert "it is a directory, not a regular file" in capsys.readouterr().err
    assert main(["check", spec, "--json", "r.json", "--sarif", "./r.json"]) == 2
    assert "--json and --sarif both write './r.json'" in capsys.readouterr().err
    # A folder that does not exist yet is fine: it is created when the file is written.
    assert main(["check", spec, "--json", str(tmp_path / "new" / "r.json")]) == 1
    assert (tmp_path / "new" / "r.json").is_file()
    capsys.readouterr()
    (tmp_path / "probe_ran").unlink()
    assert main(["check", spec, "--junit", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "probe_ran").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_folder_is_refused_before_the_probe(tmp_path: Path, spec: str) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        for path in (folder / "r.json", folder / "sub" / "r.json"):
            proc = gradwatch_cli("check", spec, "--json", str(path), cwd=tmp_path)
            assert "Permission denied" in one_error_line(proc)
    finally:
        folder.chmod(0o755)
    assert not (tmp_path / "probe_ran").exists()


def test_report_outputs_are_checked_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    missing = str(tmp_path / "missing.json")  # would be "cannot read report" if read first
    for option, what in (("--html", "HTML report"), ("--junit", "JUnit XML")):
        assert main(["report", missing, option, str(blocker / "x")]) == 2
        captured = capsys.readouterr()
        assert captured.out == "", captured.out
        assert f"cannot write {what} ({option}) '{blocker / 'x'}'" in captured.err


# -- argparse errors: one line, no usage block --------------------------------------------------


def test_unknown_option_is_one_line_with_the_closest_option(tmp_path: Path, spec: str) -> None:
    line = one_error_line(gradwatch_cli("check", spec, "--ignore-checks", GHOST_ID, cwd=tmp_path))
    assert line == (
        "gradwatch check: error: unknown option --ignore-checks (did you mean --ignore-check?); "
        "see 'gradwatch check --help'"
    )
    assert not (tmp_path / "probe_ran").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "gradwatch: error: the following arguments are required: COMMAND"),
        (["chek"], "gradwatch: error: argument COMMAND: invalid choice: 'chek'"),
        (["check"], "gradwatch check: error: the following arguments are required: TARGET"),
        (["check", "t.py:b", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (
            ["check", "t.py:b", "--fail_on=info"],
            "unknown option --fail_on (did you mean --fail-on?)",
        ),
        (["check", "t.py:b", "extra"], "gradwatch check: error: unexpected argument 'extra'"),
        (["report", "r.json", "--htlm", "x"], "unknown option --htlm (did you mean --html?)"),
        (["--nope", "schema"], "unknown option --nope"),
        (["schema", "nope"], "gradwatch schema: error: argument which: invalid choice: 'nope'"),
        (["check", "t.py:b", "--style", "a\nb"], "invalid choice: 'a\\nb'"),
    ],
)
def test_usage_errors_are_one_line_with_a_help_hint(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert expected in err and err.rstrip().endswith("--help'"), err


def test_help_still_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradwatch check") and "--update-baseline FILE" in out
    # --select's help names the checks that always run (written out: --help imports no torch).
    assert all(cls.id in " ".join(out.split()) for cls in SELF_CHECKS), out


# -- the table style at 80 columns ----------------------------------------------------------


def test_table_style_at_80_columns_splits_no_name(tmp_path: Path, spec: str) -> None:
    proc = gradwatch_cli("check", spec, "--style", "table", columns=80, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, proc.stdout
    # The check id, the longest parameter name and the hint's identifier, each whole.
    for word in (GHOST_ID, LONG_NAME, "find_unused_parameters=True"):
        assert any(word in line for line in lines), f"{word!r} split:\n{proc.stdout}"
