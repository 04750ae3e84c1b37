"""resume_mismatch through the HF callback: the watcher's state saved into each Trainer
checkpoint folder and loaded by ``train(resume_from_checkpoint=...)``; a checkpoint that
lost its optimizer or scheduler file resumes wrongly and is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradwatch.checks.resume_mismatch import ResumeMismatch  # noqa: E402
from gradwatch.transformers import GradWatchCallback  # noqa: E402
from gradwatch.transformers.callback import STATE_NAME  # noqa: E402


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.body(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _train(out: Path, max_steps: int, resume: Any = None) -> GradWatchCallback:
    torch.manual_seed(0)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False, log_metrics=False)
    args = transformers.TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=Regressor(), args=args, train_dataset=Pairs(), callbacks=[cb]
    )
    trainer.train(resume_from_checkpoint=resume)
    return cb


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "out"
    _train(out, max_steps=3)
    assert (out / "checkpoint-3" / STATE_NAME).is_file()
    return out


def _copy(saved: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(saved, out)
    for name in drop:
        (out / "checkpoint-3" / name).unlink()
    return out


def test_trainer_resume_from_checkpoint_is_silent(saved: Path, tmp_path: Path) -> None:
    out = _copy(saved, tmp_path)
    cb = _train(out, max_steps=6, resume=str(out / "checkpoint-3"))
    assert cb.report is not None
    assert not cb.report.by_check(ResumeMismatch.id), [f.line() for f in cb.report.findings]
    assert cb.report.steps == 6  # the restored counters continue


def test_checkpoint_without_its_optimizer_state(saved: Path, tmp_path: Path) -> None:
    out = _copy(saved, tmp_path, drop=("optimizer.pt",))
    cb = _train(out, max_steps=6, resume=str(out / "checkpoint-3"))
    assert cb.report is not None
    found = {f.details["aspect"]: f for f in cb.report.by_check(ResumeMismatch.id)}
    assert "optimizer" in found, [f.line() for f in cb.report.findings]
    assert found["optimizer"].severity == "error" and found["optimizer"].first_step == 3


def test_checkpoint_without_its_scheduler_state(saved: Path, tmp_path: Path) -> None:
    out = _copy(saved, tmp_path, drop=("scheduler.pt",))
    cb = _train(out, max_steps=6, resume=str(out / "checkpoint-3"))
    assert cb.report is not None
    found = {f.details["aspect"] for f in cb.report.by_check(ResumeMismatch.id)}
    assert found & {"lr", "scheduler"}, [f.line() for f in cb.report.findings]
