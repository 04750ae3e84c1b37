"""The Lightning callback follows Lightning's conventions: its logging steps, its progress bar,
a job that fails on a failed report, and a LightningCLI error of one line.

Console output and exit codes are read from real subprocesses (a script run with the
Trainer's default progress bar), since that is where users see them.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_helpers import ManualRegressor, Regressor, loader, trainer
from pytorch_lightning.loggers import CSVLogger
from torch import nn

import gradwatch
from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

HELPERS = Path(__file__).resolve().parents[1] / "_helpers"


class LoggingRegressor(Regressor):
    """Logs its own loss every step, so the CSV shows where Lightning logs."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss


class LoggingManual(ManualRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss, on_step=True, on_epoch=False)


def _rows_by_step(logger: CSVLogger) -> dict[int, dict[str, float]]:
    """Lightning's and gradwatch's rows of one step merged (each logs its own row)."""
    merged: dict[int, dict[str, float]] = defaultdict(dict)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            merged[int(row["step"])].update({k: float(v) for k, v in row.items() if v})
    return dict(merged)


# name -> (module, Trainer kwargs, gradwatch every_n_steps)
LOG_MODES: dict[str, tuple[type, dict[str, Any], int]] = {
    "every_2": (LoggingRegressor, {"log_every_n_steps": 2}, 1),
    "every_3_two_epochs": (
        LoggingRegressor,
        {"log_every_n_steps": 3, "max_steps": -1, "max_epochs": 2, "limit_train_batches": 5},
        1,
    ),
    "accumulate_2": (
        LoggingRegressor,
        {
            "log_every_n_steps": 2,
            "accumulate_grad_batches": 2,
            "max_steps": 5,
            "limit_train_batches": 10,
        },
        1,
    ),
    "manual_every_3": (
        LoggingManual,
        {"log_every_n_steps": 3, "max_steps": 7, "limit_train_batches": 7},
        1,
    ),
    "observed_every_2_logged_every_3": (
        LoggingRegressor,
        {"log_every_n_steps": 3, "max_steps": 8, "limit_train_batches": 8},
        2,
    ),
}


@pytest.mark.parametrize("mode", list(LOG_MODES))
def test_metrics_go_out_on_the_steps_lightning_logs(tmp_path: Path, mode: str) -> None:
    make, kw, every = LOG_MODES[mode]
    torch.manual_seed(0)
    cb = GradWatchCallback(config={"every_n_steps": every}, print_summary=False)
    logger = CSVLogger(tmp_path)
    trainer(tmp_path, cb, logger=logger, **kw).fit(make(), loader())
    rows = _rows_by_step(logger)
    lightning_steps = sorted(s for s, r in rows.items() if "train_loss" in r)
    ours = sorted(s for s, r in rows.items() if "gradwatch/grad_norm_total" in r)
    assert lightning_steps, rows
    assert ours == lightning_steps  # every logging step here follows a fresh observation
    report = cb.report
    assert report is not None
    hist = {layer.name: dict(layer.history) for layer in report.layers if layer.history}
    for step in ours:
        observed = max(s for s in hist["body.0"] if s <= step)  # the latest observed step
        assert step - observed < every
        logged = rows[step]["gradwatch/grad_norm/body.0"]
        assert logged == pytest.approx(hist["body.0"][observed], rel=1e-6)


def test_log_every_n_steps_zero_logs_nothing(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    logger = CSVLogger(tmp_path)
    trainer(tmp_path, cb, logger=logger, log_every_n_steps=0).fit(LoggingRegressor(), loader())
    path = Path(logger.log_dir) / "metrics.csv"
    assert not path.exists() or "gradwatch/" not in path.read_text()
    assert cb.report is not None and cb.report.steps == 6


SCRIPT = """
import sys
sys.path.insert(0, {helpers!r})
import pytorch_lightning as pl
from _lightning_helpers import Regressor, loader
from gradwatch.lightning import GradWatchCallback

bar, ghost, fail = sys.argv[1], sys.argv[2] == "ghost", sys.argv[3] == "fail"
callbacks = [GradWatchCallback(config={{"every_n_steps": 1}}, fail_on_report=fail)]
if bar == "tqdm":
    from pytorch_lightning.callbacks import TQDMProgressBar
    callbacks.append(TQDMProgressBar())
else:
    from pytorch_lightning.callbacks import RichProgressBar
    callbacks.append(RichProgressBar())
trainer = pl.Trainer(
    accelerator="cpu", max_steps=6, limit_train_batches=6, logger=False,
    enable_checkpointing=False, enable_model_summary=False, callbacks=callbacks,
    default_root_dir=sys.argv[4],
)
trainer.fit(Regressor(ghost=ghost), loader())
print("AFTER FIT")
"""


def _run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(helpers=str(HELPERS)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-W", "ignore::FutureWarning", str(script), *args, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.slow
@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_summary_prints_after_the_progress_bar(tmp_path: Path, bar: str) -> None:
    proc = _run_script(tmp_path, bar, "ghost", "pass")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.replace("\r", "\n").splitlines()
    bar_lines = [i for i, line in enumerate(lines) if "Epoch 0" in line]
    summary = [i for i, line in enumerate(lines) if line.startswith("gradwatch: FAILED")]
    finding = [i for i, line in enumerate(lines) if "error[ghost_param]" in line]
    assert bar_lines and summary and finding, proc.stdout[-3000:]
    assert max(bar_lines) < min(finding) < min(summary), proc.stdout[-3000:]
    # the warnings came out as lines of their own, not glued to a line of the bar
    out = proc.stdout + proc.stderr
    warned = [p for line in out.splitlines() for p in line.split("\r") if "GradWatchWarning" in p]
    assert warned, out[-3000:]
    assert not [part for part in warned if "Epoch 0" in part or "it/s" in part], warned


@pytest.mark.slow
def test_warnings_do_not_break_the_tqdm_line(tmp_path: Path) -> None:
    """stdout and stderr into one pipe, as a terminal shows them: no warning on a bar line."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(helpers=str(HELPERS)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore::FutureWarning",
            str(script),
            "tqdm",
            "ghost",
            "pass",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    # what a terminal shows: a carriage return goes back to the start of the line
    shown = [part for line in proc.stdout.splitlines() for part in line.split("\r")]
    warned = [part for part in shown if "GradWatchWarning" in part]
    assert warned, proc.stdout[-3000:]
    assert not [part for part in warned if "Epoch 0" in part or "it/s" in part], warned


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ghost", "fail", "code"),
    [("ghost", "fail", 1), ("clean", "fail", 0), ("ghost", "pass", 0)],
)
def test_fail_on_report_sets_the_exit_status(
    tmp_path: Path, ghost: str, fail: str, code: int
) -> None:
    proc = _run_script(tmp_path, "tqdm", ghost, fail)
    assert proc.returncode == code, proc.stderr[-3000:]
    report = gradwatch.Report.read(tmp_path / "gradwatch-report.json")
    assert report.failed is (ghost == "ghost")
    if code:
        assert "AFTER FIT" not in proc.stdout
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gradwatch.errors.GhostLayerError: gradwatch found 1 problem")
        assert "ghost.weight" in last
        # the summary was printed before the job failed, after the bar
        assert "gradwatch: FAILED" in proc.stdout
    else:
        assert "AFTER FIT" in proc.stdout


def test_fail_on_report_raises_from_fit(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False, fail_on_report=True)
    with pytest.raises(gradwatch.GhostLayerError, match=r"ghost\.weight"):
        trainer(tmp_path, cb).fit(Regressor(ghost=True), loader())
    assert cb.report is not None and cb.report.failed
    assert cb.watcher is None
    # the same callback on a clean model: fit returns
    trainer(tmp_path, cb).fit(Regressor(), loader())
    assert cb.report is not None and not cb.report.failed


CLI_SCRIPT = """
import sys
sys.path.insert(0, {helpers!r})
from pytorch_lightning.cli import LightningCLI
from _lightning_helpers import Regressor, loader

class CLIRegressor(Regressor):
    def train_dataloader(self):
        return loader()

LightningCLI(CLIRegressor, save_config_callback=None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["missing", "misspelt_key"])
def test_lightning_cli_bad_gradwatch_config_is_a_short_error(tmp_path: Path, problem: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(CLI_SCRIPT.format(helpers=str(HELPERS)))
    name = "gradwach.yaml"  # misspelt: no such file
    if problem == "misspelt_key":
        name = "gradwatch.yaml"
        (tmp_path / name).write_text("every_n_step: 2\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            str(script),
            "fit",
            "--seed_everything=0",
            "--trainer.max_steps=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks+=gradwatch.lightning.GradWatchCallback",
            f"--trainer.callbacks.config={name}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) <= 5, proc.stderr
    (line,) = [line for line in err if line.startswith("error:")]
    if problem == "missing":
        assert name in line and "cannot read" in line
    else:  # jsonargparse read the file itself and passed its mapping: the key is named
        assert "unknown key 'every_n_step'" in line
    assert "Traceback" not in proc.stderr


def _framework_dirs() -> tuple[str, ...]:
    import pytorch_lightning

    mods = [torch, pytorch_lightning, gradwatch]
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in mods)


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda: Regressor(ghost=True), __file__),  # automatic: the trainer.fit() line
        (lambda: ManualRegressor(ghost=True), str(HELPERS / "_lightning_helpers.py")),  # opt.step()
    ],
    ids=["automatic", "manual"],
)
def test_lightning_warning_points_at_the_users_line(tmp_path: Path, make: Any, where: str) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradwatch.GradWatchWarning)
        trainer(tmp_path, cb).fit(make(), loader())
    ours = [w for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)]
    assert ours, [str(w.message) for w in caught]
    for w in ours:
        assert not w.filename.startswith(_framework_dirs()), w.filename
        assert os.path.abspath(w.filename) == os.path.abspath(where)


def test_recorded_warnings_stay_with_the_recorder_under_a_progress_bar(tmp_path: Path) -> None:
    """``pytest.warns`` (any ``catch_warnings(record=True)``) still gets gradwatch's warnings
    while a progress bar is live: they are routed through the bar only for the console."""
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    with pytest.warns(gradwatch.GradWatchWarning, match="ghost"):
        trainer(tmp_path, cb, enable_progress_bar=True).fit(Regressor(ghost=True), loader())
    assert warnings.showwarning.__module__ == "warnings"  # the hook was taken out again
