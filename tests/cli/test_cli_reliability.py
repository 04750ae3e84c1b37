"""The command line never reports a pass it did not earn, and its errors stay one line:
another instance trained, NaN weights, a tampered saved report, huge reports, odd paths,
broken pipes, and warnings-as-errors filters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GHOST = str(ROOT / "examples" / "ci_ghost.py") + ":build"
CLEAN = str(ROOT / "examples" / "ci_clean.py") + ":build"

HEADER = """\
import copy
import torch
from torch import nn
from torch.nn import functional as F
import gradwatch

def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
"""


def gradwatch_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradwatch", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )


def target(tmp_path: Path, body: str) -> str:
    path = tmp_path / "probe_target.py"
    path.write_text(HEADER + textwrap.dedent(body), encoding="utf-8")
    return f"{path}:build"


def test_probe_whose_loss_trains_another_instance_fails(tmp_path: Path) -> None:
    spec = target(
        tmp_path,
        """
        def build():
            model = nn.Linear(4, 1)
            other = copy.deepcopy(model)
            return gradwatch.Probe(
                model=model,
                batch=data(),
                loss_fn=lambda m, b: F.mse_loss(other(b[0]), b[1]),  # not `m`
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            )
        """,
    )
    proc = gradwatch_cli("check", spec, "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failed"]
    unobserved = [f for f in report["findings"] if f["check"] == "not_observed"]
    # the probes, on copies, cannot judge a loss that ignores the model either (their own
    # not_observed reasons); the watched steps' verdict is never_ran
    assert "never_ran" in [f["details"]["reason"] for f in unobserved]
    # The copy's parameters get the gradients outside the watched model: if named, as loose.
    loose = [f for f in report["findings"] if f["check"] == "unregistered_param"]
    assert {f["details"].get("cause") for f in loose} <= {"loose"}


NONFINITE_PARAM = "nonfinite_param" in {c.id for c in ALL_CHECKS}


@pytest.mark.xfail(not NONFINITE_PARAM, reason="nonfinite_param (issue 29)", strict=True)
def test_check_fails_on_nan_weights_with_finite_gradients(tmp_path: Path) -> None:
    spec = target(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                # NaN weights behind a finite gradient: the NaN never reaches the loss.
                return self.head(x) + 0 * torch.nan_to_num(self.body(x)).sum()

        def build():
            model = Net()
            with torch.no_grad():
                model.body.weight[0, 0] = float("nan")
            return gradwatch.Probe(
                model=model,
                batch=data(),
                loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            )
        """,
    )
    proc = gradwatch_cli("check", spec, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def _saved_failing_report(tmp_path: Path) -> Path:
    out = tmp_path / "ghost.json"
    proc = gradwatch_cli("check", GHOST, "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    return out


@pytest.mark.slow
def test_report_recomputes_failed_from_findings_and_fail_on(tmp_path: Path) -> None:
    saved = _saved_failing_report(tmp_path)
    data = json.loads(saved.read_text())
    data["failed"] = False
    (tmp_path / "lie.json").write_text(json.dumps(data))
    del data["failed"]
    (tmp_path / "dropped.json").write_text(json.dumps(data))
    for name in ("lie.json", "dropped.json"):
        proc = gradwatch_cli("report", name, cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout
        assert "FAILED" in proc.stdout and "passed" not in proc.stdout
    data["fail_on"] = "never"  # the saved fail_on is honoured
    (tmp_path / "never.json").write_text(json.dumps(data))
    assert gradwatch_cli("report", "never.json", cwd=tmp_path).returncode == 0

    # A huge finding message is read but not printed whole.
    data["fail_on"] = "error"
    data["findings"][0]["message"] = "m" * (8 << 20)
    (tmp_path / "huge.json").write_text(json.dumps(data))
    outputs = ["--junit", "r.xml", "--sarif", "r.sarif"]
    proc = gradwatch_cli("report", "huge.json", *outputs, cwd=tmp_path)
    assert proc.returncode == 1 and len(proc.stdout) < 64_000
    assert "more characters" in proc.stdout
    for name in ("r.xml", "r.sarif"):
        assert (tmp_path / name).stat().st_size < 1 << 20


def test_report_read_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = gradwatch_cli("report", "/dev/zero", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2  # a device is refused unread, as config files are (issue 44.3)
    assert proc.stderr.count("\n") == 1 and "a character device" in proc.stderr
    big = tmp_path / "big.json"
    with big.open("wb") as fh:  # a sparse file past the bound: read up to it, not whole
        fh.truncate((256 << 20) + 2)
    assert main(["report", str(big)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "larger than" in err


def test_newline_in_an_output_path_keeps_the_one_line_reason(tmp_path: Path) -> None:
    name = "a\n" + "x" * 300 + ".xml"  # a name too long for the file system
    proc = gradwatch_cli("check", CLEAN, "--junit", name, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gradwatch:")]
    assert len(lines) == 1, proc.stderr
    assert "a\\x0axxx" in lines[0] and lines[0].endswith("File name too long"), lines[0]


def test_broken_pipe_is_not_the_findings_exit_code(tmp_path: Path) -> None:
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the schema (40 KB) cannot fit in it
    with subprocess.Popen(
        [sys.executable, "-m", "gradwatch", "schema", "report"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    ) as proc:
        os.close(write_end)
        assert proc.stderr is not None
        os.read(read_end, 10)
        os.close(read_end)  # the reader goes away, as `| head -c 10` does
        assert proc.wait(timeout=60) == 141
        assert b"Traceback" not in proc.stderr.read()


def test_sarif_uri_never_leaves_the_source_root(tmp_path: Path) -> None:
    saved = _saved_failing_report(tmp_path)
    data = json.loads(saved.read_text())
    data["findings"][0]["details"]["called_at"] = "../../etc/passwd:1"
    data["findings"][0]["details"]["defined_at"] = "a/../../../x.py:3"
    (tmp_path / "evil.json").write_text(json.dumps(data))
    proc = gradwatch_cli("report", "evil.json", "--sarif", "out.sarif", cwd=tmp_path)
    assert proc.returncode == 1
    text = (tmp_path / "out.sarif").read_text()
    assert "passwd" not in text and "x.py" not in text


def test_warnings_as_errors_never_abort_the_step(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, gradwatch
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = nn.Linear(2, 1)
                    self.ghost = nn.Linear(2, 1)

                def forward(self, x):
                    return self.body(x)

            model = Net()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with gradwatch.watch(model, opt) as w:
                for i in range(3):
                    opt.zero_grad()
                    x = torch.randn(4, 2)
                    if i == 1:
                        x[0, 0] = float("nan")  # a non-finite step: backward's own hook warns
                    model(x).sum().backward()
                    opt.step()
            print("trained", sorted({f.check for f in w.report().findings}))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # The NaN input makes the loss non-finite too: nonfinite_param says so (SPEC section 6).
    expected = ["ghost_param", "nonfinite_grad"] + (["nonfinite_param"] if NONFINITE_PARAM else [])
    assert f"trained {expected}" in proc.stdout
    assert "GradWatchWarning" in proc.stderr  # shown, not raised
