"""resume_mismatch through the Lightning callback: its checkpoint state holds what the resume
must restore; a Trainer ``ckpt_path`` resume is silent, another checkpoint's weights are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_helpers import Regressor, loader, pl, trainer

from gradwatch.checks.resume_mismatch import ResumeMismatch
from gradwatch.lightning import GradWatchCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    # the resumed fit checkpoints nothing: Lightning asks for the saving callbacks back
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
]


class AdamRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}


def _fit(root: Path, max_steps: int, ckpt: Any = None, save: bool = False) -> GradWatchCallback:
    torch.manual_seed(0)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    extra: list[Any] = []
    if save:
        extra.append(
            pl.callbacks.ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=3, save_top_k=-1)
        )
    t = trainer(
        root,
        cb,
        *extra,
        max_steps=max_steps,
        limit_train_batches=3,
        enable_checkpointing=save,
    )
    t.fit(AdamRegressor(), loader(), ckpt_path=str(ckpt) if ckpt else None)
    return cb


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pl")
    _fit(root, max_steps=6, save=True)
    first, second = sorted((root / "ck").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return first, second


def _mismatches(cb: GradWatchCallback) -> dict[str, Any]:
    assert cb.report is not None
    return {f.details["aspect"]: f for f in cb.report.by_check(ResumeMismatch.id)}


def test_trainer_ckpt_path_resume_is_silent(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    first, _ = checkpoints
    state = torch.load(first, weights_only=True)
    (gw,) = [v for k, v in state["callbacks"].items() if "GradWatchCallback" in k]
    assert gw["resume"]["steps"] == 3  # saved during the fit, with what a resume restores
    cb = _fit(tmp_path, max_steps=6, ckpt=first)
    assert not _mismatches(cb), [f.line() for f in cb.report.findings]  # type: ignore[union-attr]


def test_weights_of_another_checkpoint(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    first, second = checkpoints
    mixed = torch.load(first, weights_only=True)
    mixed["state_dict"] = torch.load(second, weights_only=True)["state_dict"]
    path = tmp_path / "mixed.ckpt"
    torch.save(mixed, path)
    found = _mismatches(_fit(tmp_path, max_steps=6, ckpt=path))
    assert set(found) == {"params"}, found
    assert set(found["params"].params) == {
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
    }
    assert found["params"].first_step == 3
