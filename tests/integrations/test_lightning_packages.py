"""One callback for both Lightning packages: ``lightning.pytorch`` and ``pytorch_lightning``.

Both are installed side by side here, as they often are for users. Each test runs a real
Trainer (and LightningCLI) of one package with a LightningModule of the same package.
"""

from __future__ import annotations

import csv
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradwatch
from gradwatch.lightning import LIGHTNING_PACKAGES, GradWatchCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::jsonargparse._deprecated.JsonargparseDeprecationWarning"),
]

PACKAGES = ["lightning.pytorch", "pytorch_lightning"]
DIM = 8


def _pl(name: str) -> ModuleType:
    return pytest.importorskip(name)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, DIM, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=8)


def _module_class(pl: ModuleType) -> type:
    """A LightningModule of package ``pl``; ``ghost=True`` adds a layer forward never calls."""

    class Regressor(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self, ghost: bool = False) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
            self.ghost = nn.Linear(DIM, DIM) if ghost else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader:
            return _loader()

    return Regressor


def _trainer(pl: ModuleType, root: Path, cb: Any, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        "default_root_dir": str(root),
        "callbacks": [cb],
    }
    args.update(kw)
    return pl.Trainer(**args)


def test_both_packages_are_installed_and_the_callback_is_a_callback_of_each() -> None:
    assert set(LIGHTNING_PACKAGES) == set(PACKAGES)  # the environment this file is about
    cb = GradWatchCallback()
    for name in PACKAGES:
        assert isinstance(cb, importlib.import_module(name).Callback), name


@pytest.mark.parametrize("package", PACKAGES)
def test_trainer_of_each_package_finds_the_ghost(package: str, tmp_path: Path) -> None:
    pl = _pl(package)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _trainer(pl, tmp_path, cb)
    trainer.fit(_module_class(pl)(ghost=True))
    assert cb.report is not None and cb.report.steps == 4
    (ghost,) = cb.report.by_check("ghost_param")
    assert sorted(ghost.params) == ["ghost.bias", "ghost.weight"]


@pytest.mark.parametrize("package", PACKAGES)
def test_clean_model_is_silent_under_each_package(package: str, tmp_path: Path) -> None:
    pl = _pl(package)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    _trainer(pl, tmp_path, cb, accumulate_grad_batches=2).fit(_module_class(pl)())
    assert cb.report is not None and cb.report.steps == 4
    assert [f.line() for f in cb.report.findings if f.severity != "info"] == []


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("package", PACKAGES)
def test_report_goes_to_each_runs_versioned_dir_and_ghost_has_a_zero_series(
    package: str, tmp_path: Path
) -> None:
    pl = _pl(package)
    seen = []
    for ghost in (True, False):  # two runs, one logger folder: the second must not overwrite
        cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
        logger = pl.loggers.CSVLogger(tmp_path)
        _trainer(pl, tmp_path, cb, logger=logger).fit(_module_class(pl)(ghost=ghost))
        assert cb.report_path == Path(logger.log_dir) / "gradwatch-report.json"
        assert Path(logger.log_dir).name == f"version_{len(seen)}"
        seen.append((cb.report_path, Path(logger.log_dir) / "metrics.csv"))
    (ghost_report, ghost_csv), (clean_report, clean_csv) = seen
    assert gradwatch.Report.read(ghost_report).by_check("ghost_param")
    assert gradwatch.Report.read(clean_report).findings == []

    rows = _rows(ghost_csv)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["gradwatch/grad_norm/ghost"]) for r in rows] == [0.0] * 4
    assert all(float(r["gradwatch/grad_norm/body.0"]) > 0 for r in rows)
    assert "gradwatch/grad_norm/ghost" not in _rows(clean_csv)[0]


@pytest.fixture
def _bare_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when both ``args`` and a command line (pytest's) are present."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


@pytest.mark.usefixtures("_bare_argv")
@pytest.mark.parametrize("package", PACKAGES)
def test_lightning_cli_class_path_under_each_package(package: str, tmp_path: Path) -> None:
    import yaml

    pl = _pl(package)
    cli_mod = importlib.import_module(f"{package}.cli")
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 3,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(tmp_path),
            "callbacks": [
                {
                    "class_path": "gradwatch.lightning.GradWatchCallback",
                    "init_args": {"config": {"every_n_steps": 1}, "print_summary": False},
                }
            ],
        },
        "model": {"ghost": True},
    }
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = cli_mod.LightningCLI(
        _module_class(pl), args=["fit", "--config", str(path)], save_config_callback=None
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, GradWatchCallback)]
    assert cb.report is not None and cb.report.steps == 3
    assert {p for f in cb.report.by_check("ghost_param") for p in f.params} == {
        "ghost.weight",
        "ghost.bias",
    }


@pytest.mark.slow  # importing mlflow alone takes ~10 s here
@pytest.mark.parametrize("package", PACKAGES)
def test_mlflow_logger_gets_the_report_as_an_artifact_and_a_zero_ghost_series(
    package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no network here
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store, no database
    pl = _pl(package)
    logger = pl.loggers.MLFlowLogger(experiment_name="gw", tracking_uri=f"file:{tmp_path}/mlruns")
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    _trainer(pl, tmp_path, cb, logger=logger).fit(_module_class(pl)(ghost=True))
    run = logger.run_id
    # Runs are kept apart by the run id, not written over one another in the save dir.
    assert cb.report_path == tmp_path / "gradwatch" / run / "gradwatch-report.json"
    client = logger.experiment
    assert [a.path for a in client.list_artifacts(run, "gradwatch")] == [
        "gradwatch/gradwatch-report.json"
    ]
    local = Path(client.download_artifacts(run, "gradwatch/gradwatch-report.json", str(tmp_path)))
    assert gradwatch.Report.read(local).by_check("ghost_param")
    history = client.get_metric_history(run, "gradwatch/grad_norm/ghost")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0)]
