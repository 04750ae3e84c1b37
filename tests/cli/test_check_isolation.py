"""``gradwatch check`` never passes without a judged probe: exits, crashes and hangs are exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gradwatch
from gradwatch.cli.main import CliError, load_target, main

ROOT = Path(__file__).resolve().parents[2]

HEADER = """\
import os, signal, subprocess, sys, time
import torch
from torch import nn
from torch.nn import functional as F
import gradwatch

def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)

def probe(loss):
    return gradwatch.Probe(nn.Linear(4, 1), data(), loss)

def mse(m, b):
    return F.mse_loss(m(b[0]), b[1])
"""


def target(tmp_path: Path, body: str) -> str:
    path = tmp_path / "iso_target.py"
    path.write_text(HEADER + textwrap.dedent(body), encoding="utf-8")
    return f"{path}:build"


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gradwatch: error: "), lines[0]
    return lines[0]


# Each of these once made `gradwatch check` exit 0 with no report.
PROCESS_EXITS = {
    "sys_exit_in_factory": (
        "def build():\n    sys.exit(0)\n",
        "factory '{t}' called sys.exit(0)",
    ),
    "sys_exit_in_loss_fn": (
        "def build():\n    return probe(lambda m, b: sys.exit(0))\n",
        "loss_fn failed at step 0: it called sys.exit(0)",
    ),
    "sys_exit_in_data": (
        "def gen():\n    yield data()\n    sys.exit(0)\n\n"
        "def build():\n    return gradwatch.Probe(nn.Linear(4, 1), gen(), mse)\n",
        "the probe called sys.exit(0) before its steps completed",
    ),
    "os_exit_in_loss_fn": (
        "def build():\n    return probe(lambda m, b: os._exit(0))\n",
        "the probe process exited with status 0 without a result",
    ),
    "os_exit_in_factory": (
        "def build():\n    os._exit(0)\n",
        "the probe process exited with status 0 without a result",
    ),
    "killed": (
        "def build():\n    os.kill(os.getpid(), signal.SIGKILL)\n",
        "the probe process was killed by SIGKILL",
    ),
}


@pytest.mark.parametrize("case", sorted(PROCESS_EXITS))
def test_a_process_exit_inside_the_probe_is_exit_2_with_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body, expected = PROCESS_EXITS[case]
    t = target(tmp_path, body)
    out_json = tmp_path / "r.json"
    assert main(["check", t, "--json", str(out_json), "--no-probes"]) == 2  # the step itself
    captured = capsys.readouterr()
    assert expected.format(t=t) in one_error_line(captured.err)
    assert not out_json.exists()  # no report was judged, so none is written


def test_sys_exit_in_a_factory_is_a_cli_error_in_process(tmp_path: Path) -> None:
    t = target(tmp_path, "def build():\n    sys.exit(3)\n")
    with pytest.raises(CliError, match=r"called sys.exit\(3\)"):
        load_target(t)


def test_timeout_stops_a_hanging_data_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = """
    def gen():
        yield data()
        time.sleep(3600)

    def build():
        return gradwatch.Probe(nn.Linear(4, 1), gen(), mse)
    """
    start = time.monotonic()
    assert main(["check", target(tmp_path, body), "--timeout", "2"]) == 2
    elapsed = time.monotonic() - start
    line = one_error_line(capsys.readouterr().err)
    assert "did not finish within 2 s (--timeout)" in line
    assert elapsed < 30  # killed at the deadline, not when the sleep ends


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_timeout_must_be_a_finite_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "x.py:build", "--timeout", value]) == 2
    assert "--timeout" in capsys.readouterr().err


def test_json_dash_writes_the_report_to_stdout_and_the_rest_to_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    body = """
    def build():
        print("hello from the factory")
        return probe(mse)
    """
    assert main(["check", target(tmp_path, body), "--json", "-", "--overfit", "--no-probes"]) == 0
    out, err = capfd.readouterr()
    report = gradwatch.Report.model_validate_json(out)  # stdout holds nothing else
    assert report.steps == 3 and not report.failed
    assert json.loads(out)["schema_version"] == 1
    assert "hello from the factory" in err and "passed" in err and "overfit: loss" in err
    assert not (tmp_path / "-").exists() and not Path("-").exists()


def test_in_process_runs_the_same_step_here(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--in-process`` (for a debugger's breakpoints): the same report, the step's prints
    kept off a ``--json -`` stdout, and its sys.exit still one line, exit 2."""
    body = """
    def build():
        print("hello from the factory")
        return gradwatch.Probe(Ghostly(), data(), mse)

    class Ghostly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.ghost = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x)
    """
    t = target(tmp_path, body)
    assert main(["check", t, "--json", "-", "--no-probes"]) == 1
    isolated = gradwatch.Report.model_validate_json(capfd.readouterr().out)
    assert main(["check", t, "--json", "-", "--no-probes", "--in-process"]) == 1
    out, err = capfd.readouterr()
    here = gradwatch.Report.model_validate_json(out)  # stdout holds nothing else
    assert "hello from the factory" in err
    assert [f.line() for f in here.findings] == [f.line() for f in isolated.findings]
    assert {f.module for f in here.by_check("ghost_param")} == {"ghost"}
    t = target(tmp_path, "def build():\n    return probe(lambda m, b: sys.exit(0))\n")
    assert main(["check", t, "--no-probes", "--in-process"]) == 2
    assert "it called sys.exit(0)" in one_error_line(capfd.readouterr().err)


def test_verbose_shows_the_child_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = target(tmp_path, "def build():\n    return probe(lambda m, b: sys.exit(0))\n")
    assert main(["check", t, "--verbose", "--no-probes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradwatch: error: loss_fn failed at step 0")
    assert "Traceback" in err and "SystemExit" in err


# -- process lifecycle (real processes, real signals) --------------------------------------


def _wait_for(path: Path, seconds: float = 120.0) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent, not us, reaps it)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


HANG_WITH_GRANDCHILD = """
def build():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open({pidfile!r}, "w") as fh:
        fh.write(str(sleeper.pid))
    with open({childfile!r}, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(3600)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile, childfile = tmp_path / "grandchild.pid", tmp_path / "child.pid"
    t = target(
        tmp_path, HANG_WITH_GRANDCHILD.format(pidfile=str(pidfile), childfile=str(childfile))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gradwatch", "check", t, "--timeout", "25"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "did not finish within 25 s" in one_error_line(proc.stderr)
    assert proc.stdout == ""
    assert _wait_dead(_wait_for(childfile, 1)) and _wait_dead(_wait_for(pidfile, 1))


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_child_exits_when_gradwatch_is_killed(tmp_path: Path) -> None:
    pidfile, childfile = tmp_path / "grandchild.pid", tmp_path / "child.pid"
    t = target(
        tmp_path, HANG_WITH_GRANDCHILD.format(pidfile=str(pidfile), childfile=str(childfile))
    )
    parent = subprocess.Popen(
        [sys.executable, "-m", "gradwatch", "check", t, "--timeout", "0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        child = _wait_for(childfile)
        grandchild = _wait_for(pidfile)
        parent.send_signal(signal.SIGKILL)  # CI cancels the job: no cleanup code runs
        parent.wait(30)
        assert _wait_dead(child), "the probe's process outlived gradwatch"
        assert _wait_dead(grandchild), "a process the probe started outlived gradwatch"
    finally:
        parent.kill()
        parent.wait()
        for pid in (_read_pid(childfile), _read_pid(pidfile)):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _read_pid(path: Path) -> int:
    text = path.read_text().strip() if path.exists() else ""
    return int(text) if text else 0
