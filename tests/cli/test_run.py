"""``gradwatch run SCRIPT``: unmodified scripts watched, their exit codes kept.

The plain loops, the GAN and the error paths run in this process (``main(["run", ...])``:
``runpy`` as ``__main__``, the global hooks removed afterwards); the framework scripts and
the DataLoader workers run in a child, as a user runs them (marked ``slow``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradwatch.cli.main import main

SCRIPTS = Path(__file__).parent / "run_scripts"
ROOT = Path(__file__).resolve().parents[2]
OPTIMIZER_INIT = torch.optim.Optimizer.__init__


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _child(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gradwatch", "run", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plain_ghost_fails_and_writes_outputs(capsys, tmp_path: Path) -> None:
    out_json, junit, sarif = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.sarif"
    html = tmp_path / "r.html"
    argv = ["--json", str(out_json), "--junit", str(junit), "--sarif", str(sarif)]
    argv += ["--html", str(html)]
    code, out, _ = _run(capsys, *argv, str(SCRIPTS / "plain.py"), "--ghost", "--steps", "5")
    assert code == 1
    assert "__name__=__main__" in out and "ghost_param" in out
    report = json.loads(out_json.read_text())
    ghost = [f for f in report["findings"] if f["check"] == "ghost_param"]
    assert ghost and ghost[0]["params"] == ["ghost.weight", "ghost.bias"]
    assert report["steps"] == 4  # the first iteration is not watched
    assert "ghost_param" in junit.read_text() and "ghost_param" in sarif.read_text()
    assert "ghost_param" in html.read_text()
    assert torch.optim.Optimizer.__init__ is OPTIMIZER_INIT  # the patch is removed


def test_plain_clean_passes_and_restores_argv(capsys) -> None:
    argv, path0 = list(sys.argv), sys.path[0]
    code, out, _ = _run(capsys, str(SCRIPTS / "plain.py"))
    assert code == 0, out
    assert "passed" in out and "1 optimizer" in out
    assert sys.argv == argv and sys.path[0] == path0


def test_gan_two_models_two_optimizers(capsys) -> None:
    code, out, _ = _run(capsys, "--select", "ghost_param", str(SCRIPTS / "gan.py"), "--ghost")
    assert code == 1
    assert "Critic:aux.weight" in out and "in 2 optimizers" in out


def test_script_exit_code_wins(capsys) -> None:
    code, out, _ = _run(capsys, str(SCRIPTS / "plain.py"), "--ghost", "--exit", "3")
    assert code == 3
    assert "ghost_param" in out  # the report is still printed


def test_uncaught_exception_exits_1_with_its_traceback(capsys) -> None:
    code, out, err = _run(
        capsys, "--fail-on", "never", str(SCRIPTS / "plain.py"), "--raise-at", "3"
    )
    assert code == 1
    assert "RuntimeError: boom at step 3" in err and 'plain.py", line' in err
    assert "run.py" not in err  # gradwatch's own frames are not shown
    assert "passed" in out  # 2 watched steps, then the crash: the report is printed


def test_missing_and_unstartable_scripts_exit_2(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = (\n")
    for script, why in [
        (tmp_path / "nope.py", "no such file"),
        (tmp_path, "not a file"),
        (bad, "SyntaxError"),
    ]:
        code, _, err = _run(capsys, str(script))
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(script) in lines[0] and why in lines[0]


def test_no_optimizer_is_not_observed(capsys, tmp_path: Path) -> None:
    script = tmp_path / "infer.py"
    script.write_text("import torch\nprint(torch.nn.Linear(2, 2)(torch.ones(1, 2)).shape)\n")
    code, out, _ = _run(capsys, str(script))
    assert code == 1
    assert "not_observed" in out and "never built a torch.optim optimizer" in out
    orphan = tmp_path / "orphan.py"
    orphan.write_text(
        "import torch\nw = torch.zeros(3, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(3):\n    (w - 1).pow(2).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    code, out, _ = _run(capsys, str(orphan))
    assert code == 1 and "belong to no nn.Module" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "needle"),
    [
        (["accel.py"], "accelerate done"),
        (["lightning_script.py"], "GradWatchCallback is the better path"),
        (["hf_trainer.py"], "hf done"),
        (["workers.py", "fork"], "workers done (fork)"),
        (["workers.py", "spawn"], "workers done (spawn)"),
    ],
)
def test_framework_scripts(script: list[str], needle: str, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    proc = _child("--json", str(report), str(SCRIPTS / script[0]), *script[1:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert needle in proc.stdout
    assert proc.stdout.count("gradwatch: passed") == 1  # workers never report
    data = json.loads(report.read_text())
    assert data["steps"] >= 2 and data["findings"] == []
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_python_dash_m_from_another_folder(tmp_path: Path) -> None:
    """``python -m gradwatch run``: the working directory and sys.path[0] are the script's."""
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    (script.parent / "helper.py").write_text("N = 4\n")
    script.write_text(
        "import os, sys, helper\nprint('cwd', os.getcwd()); print('argv', sys.argv)\n"
        "exec(open(os.path.join(os.path.dirname(__file__), 'body.py')).read())\n"
    )
    (script.parent / "body.py").write_text((SCRIPTS / "plain.py").read_text().split("\n\n\ndef")[0])
    proc = _child(str(script), "a", "--b", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # no optimizer: body.py defines, never trains
    assert f"cwd {tmp_path}" in proc.stdout
    assert f"argv [{str(script)!r}, 'a', '--b']" in proc.stdout


def test_ctrl_c_reports_and_exits_130(capsys, tmp_path: Path) -> None:
    script = tmp_path / "interrupted.py"
    body = (SCRIPTS / "plain.py").read_text()
    script.write_text(
        body.replace('raise RuntimeError(f"boom at step {step}")', "raise KeyboardInterrupt")
    )
    code, out, err = _run(capsys, str(script), "--ghost", "--raise-at", "4")
    assert code == 130
    assert "interrupted" in err and "ghost_param" in out


_PREFIXED_LOAD = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
ckpt = {"module." + k: v for k, v in model.state_dict().items()}  # saved from DataParallel
model.load_state_dict(ckpt, strict=False)  # before the loop: loads nothing
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
"""


def test_a_load_before_the_loop_is_judged(capsys, tmp_path: Path) -> None:
    """``gradwatch run`` imports gradwatch before the script: its loads are kept, and judged
    once the watcher enters."""
    script = tmp_path / "finetune.py"
    script.write_text(_PREFIXED_LOAD)
    out_json = tmp_path / "r.json"
    code, out, _ = _run(capsys, "--json", str(out_json), str(script))
    assert code == 0, out  # a warning
    (f,) = [
        f
        for f in json.loads(out_json.read_text())["findings"]
        if f["check"] == "call_without_effect"
    ]
    assert f["details"]["before_watch"] is True and f["details"]["loaded"] == 0
    assert f["details"]["called_at"].endswith("finetune.py:8")
