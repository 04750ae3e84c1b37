"""GradWatchCallback outputs: metrics through CSV/TensorBoard loggers, LightningCLI config."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_helpers import Regressor, ghost_params, loader, trainer
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

import gradwatch
from gradwatch.lightning import GradWatchCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    # LightningCLI 2.6 calls a jsonargparse API that jsonargparse 4.5x deprecates: not ours
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Same initial weights every run (an fp16 overflow, for one, depends on them)."""
    torch.manual_seed(0)


def _history(report: gradwatch.Report) -> dict[str, dict[int, float]]:
    return {layer.name: dict(layer.history) for layer in report.layers if layer.history}


def test_csv_logger_gets_metrics_every_n_steps(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 2}, print_summary=False)
    logger = CSVLogger(tmp_path)
    trainer(tmp_path, cb, logger=logger, max_steps=7, limit_train_batches=7).fit(
        Regressor(ghost=True), loader()
    )
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6]  # observed steps only
    report = cb.report
    assert report is not None
    hist = _history(report)
    assert set(hist) == {"body.0", "body.2"}
    for row in rows:
        step = int(row["step"])
        norms = {layer: float(row[f"gradwatch/grad_norm/{layer}"]) for layer in hist}
        for layer, norm in norms.items():
            assert norm == pytest.approx(hist[layer][step], rel=1e-6)
        total = float(row["gradwatch/grad_norm_total"])
        assert total == pytest.approx(sum(v * v for v in norms.values()) ** 0.5, rel=1e-6)
        assert float(row["gradwatch/findings"]) == 1.0  # the ghost, from step 0 on
    # the report goes next to the metrics, in the logger's versioned log dir
    assert cb.report_path == Path(logger.log_dir) / "gradwatch-report.json"
    assert ghost_params(gradwatch.Report.read(cb.report_path)) == {"ghost.weight", "ghost.bias"}


def test_tensorboard_logger_gets_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = GradWatchCallback(config={"every_n_steps": 3}, print_summary=False)
    logger = TensorBoardLogger(tmp_path)
    trainer(tmp_path, cb, logger=logger).fit(Regressor(), loader())
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"gradwatch/grad_norm_total", "gradwatch/grad_norm/body.0", "gradwatch/findings"} <= tags
    body0 = acc.Scalars("gradwatch/grad_norm/body.0")
    assert [e.step for e in body0] == [0, 3]
    assert cb.report is not None
    hist = _history(cb.report)["body.0"]
    assert [e.value for e in body0] == pytest.approx([hist[0], hist[3]], rel=1e-6)
    assert [e.value for e in acc.Scalars("gradwatch/findings")] == [0.0, 0.0]
    assert (Path(logger.log_dir) / "gradwatch-report.json").is_file()


class CLIRegressor(Regressor):
    """The test module with its own data, as LightningCLI needs."""

    def train_dataloader(self) -> DataLoader:
        return loader()


def _cli_config(tmp_path: Path, gw_config: Any) -> Path:
    import yaml

    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 4,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {
                    "class_path": "gradwatch.lightning.GradWatchCallback",
                    "init_args": {"config": gw_config, "print_summary": False},
                }
            ],
        },
        "model": {"ghost": True},
    }
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(autouse=True)
def _bare_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when both ``args`` and a command line (pytest's) are present."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


def _cli_callback(cli: LightningCLI) -> GradWatchCallback:
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, GradWatchCallback)]
    return cb


def test_lightning_cli_yaml_with_inline_config(tmp_path: Path) -> None:
    path = _cli_config(tmp_path, {"every_n_steps": 2, "fail_on": "warning", "ignore": ["body.*"]})
    cli = LightningCLI(CLIRegressor, args=["fit", "--config", str(path)], save_config_callback=None)
    cb = _cli_callback(cli)
    assert cb.config.every_n_steps == 2 and cb.config.fail_on == "warning"
    assert cb.report is not None and cb.report.steps == 4
    assert ghost_params(cb.report) == {"ghost.weight", "ghost.bias"}
    assert (tmp_path / "gradwatch-report.json").is_file()


def test_lightning_cli_yaml_with_config_file_path(tmp_path: Path) -> None:
    gw = tmp_path / "gradwatch.yaml"
    gw.write_text("every_n_steps: 1\nignore: ['ghost.*']\n")
    path = _cli_config(tmp_path, str(gw))
    cli = LightningCLI(CLIRegressor, args=["fit", "--config", str(path)], save_config_callback=None)
    cb = _cli_callback(cli)
    assert cb.config.ignore == ["ghost.*"]
    assert cb.report is not None and cb.report.findings == []  # the ghost is allowlisted


def test_lightning_cli_rejects_a_bad_config_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a command line a bad gradwatch config is one ``error:`` line and exit status 2."""
    path = _cli_config(tmp_path, {"every_n_step": 2})
    with pytest.raises(SystemExit) as exc:
        LightningCLI(CLIRegressor, args=["fit", "--config", str(path)], save_config_callback=None)
    assert exc.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert "unknown key 'every_n_step'" in line


def test_a_bad_config_outside_a_command_line_still_raises() -> None:
    with pytest.raises(gradwatch.ConfigError, match="every_n_step"):
        GradWatchCallback(config={"every_n_step": 2})
