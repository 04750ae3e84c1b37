"""GradWatchCallback across checkpoints, fail_fast and crashes: report kept, hooks gone."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning_helpers import ManualRegressor, Regressor, ghost_params, loader, trainer
from torch import nn

import gradwatch
from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Same initial weights every run (an fp16 overflow, for one, depends on them)."""
    torch.manual_seed(0)


def assert_unhooked(model: nn.Module) -> None:
    """No gradwatch hook is left on the parameters or modules, and the model can be re-watched."""
    for name, p in model.named_parameters():
        assert not p._backward_hooks, name
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
    for name, mod in model.named_modules():
        assert not mod._forward_hooks, name
    with gradwatch.watch(model):  # would raise "already watched" if the callback leaked
        pass


def test_checkpoint_resume_keeps_findings_and_counters(tmp_path: Path) -> None:
    first = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    t1 = trainer(tmp_path, first, max_steps=4, limit_train_batches=8)
    t1.fit(Regressor(ghost=True), loader())
    ckpt = tmp_path / "mid.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if "GradWatchCallback" in k]
    assert state["steps"] == 4 and state["report"]["findings"][0]["check"] == "ghost_param"

    second = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    t2 = trainer(tmp_path, second, max_steps=8, limit_train_batches=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t2.fit(Regressor(ghost=True), loader(), ckpt_path=str(ckpt))
    assert t2.global_step == 8
    report = second.report
    assert report is not None
    assert report.steps == 8
    (ghost,) = report.by_check("ghost_param")
    assert (ghost.first_step, ghost.last_step, ghost.count) == (0, 7, 8)
    assert ghost_params(report) == {"ghost.weight", "ghost.bias"}
    # already warned before the checkpoint: not warned again after the resume
    assert not [w for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)]
    # layer statistics continue at the restored step numbers
    body = next(layer for layer in report.layers if layer.name == "body.0")
    assert [s for s, _ in body.history] == [4, 5, 6, 7]


def test_fail_fast_raises_out_of_fit_naming_the_params(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"fail_fast": True})
    model = Regressor(ghost=True)
    t = trainer(tmp_path, cb)
    with pytest.raises(gradwatch.GhostLayerError, match=r"ghost\.weight, ghost\.bias"):
        t.fit(model, loader())
    assert t.global_step <= 1  # stopped at the first step, not after six
    assert cb.report is not None and cb.report.failed
    assert cb.report.by_check("ghost_param")[0].first_step == 0
    assert gradwatch.Report.read(tmp_path / "gradwatch-report.json").failed
    assert cb.watcher is None
    assert_unhooked(model)


def test_fail_fast_missing_zero_grad_in_manual_optimization(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"fail_fast": True}, print_summary=False)
    model = ManualRegressor(zero_grad=False)
    with pytest.raises(gradwatch.GradWatchError, match=r"missing_zero_grad.*body\.0\.weight"):
        trainer(tmp_path, cb).fit(model, loader())
    report = cb.report
    # raised at the second step: the first one to consume stale gradients
    assert report is not None and report.steps == 2
    assert report.by_check("missing_zero_grad")[0].first_step == 1
    assert_unhooked(model)


class Crashes(Regressor):
    """A user bug unrelated to gradients: training_step raises at batch 3."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            raise ValueError("user bug at batch 3")
        return super().training_step(batch, batch_idx)


def test_user_exception_still_gives_report_and_removes_hooks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1})
    model = Crashes()
    with pytest.raises(ValueError, match="user bug at batch 3"):
        trainer(tmp_path, cb).fit(model, loader())
    assert cb.report is not None and cb.report.steps == 3 and cb.report.findings == []
    assert (tmp_path / "gradwatch-report.json").is_file()
    assert "gradwatch:" not in capsys.readouterr().out  # a clean summary would only be noise
    assert_unhooked(model)


def test_a_second_fit_gets_a_fresh_watcher(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    model = Regressor(ghost=True)
    trainer(tmp_path, cb, max_steps=2).fit(model, loader())
    assert cb.report is not None and cb.report.steps == 2
    model.ghost = None  # fixed between the two fits
    trainer(tmp_path, cb, max_steps=3).fit(model, loader())
    assert cb.report is not None and cb.report.steps == 3 and cb.report.findings == []
    assert_unhooked(model)
