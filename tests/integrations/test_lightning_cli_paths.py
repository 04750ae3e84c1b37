"""A gradwatch config path under LightningCLI that is not where the user thinks: one line.

Real subprocesses, as a user runs them: the project is in ``proj/`` (``train.py``,
``configs/gradwatch.yaml``, ``configs/train.yaml``) and the job starts from another folder.
Three forms: the path on the command line relative to the project, the same path inside a
``--config`` file, and a misspelt file name. Each is one ``error:`` line that names where
the file was looked for (and the close name beside it), with exit status 2.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).resolve().parents[1] / "_helpers"

SCRIPT = """
import sys
sys.path.insert(0, {helpers!r})
from pytorch_lightning.cli import LightningCLI
from _lightning_helpers import Regressor, loader

class CLIRegressor(Regressor):
    def train_dataloader(self):
        return loader()

LightningCLI(CLIRegressor, save_config_callback=None)
"""

TRAIN_YAML = """
seed_everything: 0
trainer:
  max_steps: 2
  logger: false
  enable_checkpointing: false
  callbacks:
    - class_path: gradwatch.lightning.GradWatchCallback
      init_args:
        config: configs/gradwatch.yaml
"""

FLAGS = ["--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
CALLBACK = "--trainer.callbacks+=gradwatch.lightning.GradWatchCallback"


def _project(tmp_path: Path) -> tuple[Path, Path]:
    proj, elsewhere = tmp_path / "proj", tmp_path / "jobs"
    (proj / "configs").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "train.py").write_text(SCRIPT.format(helpers=str(HELPERS)))
    (proj / "configs" / "gradwatch.yaml").write_text("every_n_steps: 2\n")
    (proj / "configs" / "train.yaml").write_text(TRAIN_YAML)
    return proj, elsewhere


def _run(cwd: Path, script: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), "fit", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) <= 3, proc.stderr
    return line


def test_a_path_relative_to_the_project_run_from_elsewhere(tmp_path: Path) -> None:
    proj, elsewhere = _project(tmp_path)
    line = _run(
        elsewhere,
        proj / "train.py",
        *FLAGS,
        CALLBACK,
        "--trainer.callbacks.config=configs/gradwatch.yaml",
    )
    assert "configs/gradwatch.yaml: cannot read config file" in line
    assert f"looked for '{elsewhere / 'configs' / 'gradwatch.yaml'}'" in line
    assert "from the working directory" in line and f"no folder '{elsewhere / 'configs'}'" in line


def test_the_same_path_inside_a_config_file_run_from_elsewhere(tmp_path: Path) -> None:
    proj, elsewhere = _project(tmp_path)
    line = _run(elsewhere, proj / "train.py", "--config", str(proj / "configs" / "train.yaml"))
    assert f"looked for '{elsewhere / 'configs' / 'gradwatch.yaml'}'" in line


def test_a_misspelt_file_name_names_the_close_one(tmp_path: Path) -> None:
    proj, elsewhere = _project(tmp_path)
    given = proj / "configs" / "gradwach.yaml"
    line = _run(
        elsewhere, proj / "train.py", *FLAGS, CALLBACK, f"--trainer.callbacks.config={given}"
    )
    assert f"{given}: cannot read config file" in line
    assert f"did you mean '{proj / 'configs' / 'gradwatch.yaml'}'?" in line
    assert "from the working directory" not in line  # an absolute path
