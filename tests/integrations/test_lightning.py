"""GradWatchCallback on a real CPU Trainer: each training mode, clean and with a ghost layer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _examples import RunExample
from _lightning_helpers import (
    GAN,
    ManualRegressor,
    Regressor,
    ghost_params,
    loader,
    problems,
    trainer,
)
from pytorch_lightning.plugins.precision import MixedPrecision

import gradwatch
from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

CFG = {"every_n_steps": 1}


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Same initial weights every run (an fp16 overflow, for one, depends on them)."""
    torch.manual_seed(0)


def _fp16_cpu_plugin(init_scale: float = 2.0**16) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def _fp16_cpu_supported() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum()
        torch.amp.GradScaler("cpu")
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


# name -> (module factory, Trainer kwargs, expected optimizer steps on the 6-step budget)
MODES: dict[str, tuple[Callable[[bool], Any], Callable[[], dict[str, Any]], int]] = {
    "automatic": (lambda g: Regressor(ghost=g), dict, 6),
    "accumulate_grad_batches": (
        lambda g: Regressor(ghost=g),
        lambda: {"accumulate_grad_batches": 3, "max_steps": 4},
        4,
    ),
    "manual": (lambda g: ManualRegressor(ghost=g), dict, 6),
    "gan_two_optimizers": (lambda g: GAN(ghost=g), lambda: {"max_steps": 12}, 12),
    "bf16-mixed": (lambda g: Regressor(ghost=g), lambda: {"precision": "bf16-mixed"}, 6),
    "16-mixed_gradscaler_cpu": (
        lambda g: Regressor(ghost=g),
        lambda: {"plugins": [_fp16_cpu_plugin()]},
        6,
    ),
    "fast_dev_run": (lambda g: Regressor(ghost=g), lambda: {"fast_dev_run": True}, 1),
    "gradient_clip_val": (
        lambda g: Regressor(ghost=g),
        lambda: {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
        6,
    ),
    "clip_value_with_accumulation": (
        lambda g: Regressor(ghost=g),
        lambda: {
            "gradient_clip_val": 0.01,
            "gradient_clip_algorithm": "value",
            "accumulate_grad_batches": 2,
            "max_steps": 3,
        },
        3,
    ),
}


def _skip_unsupported(mode: str) -> None:
    if mode.startswith("16-mixed") and not _fp16_cpu_supported():
        pytest.skip("torch on this machine has no float16 autocast/GradScaler on CPU")


def _fit(tmp_path: Path, mode: str, ghost: bool, **cb_kw: Any) -> GradWatchCallback:
    make, kw, _ = MODES[mode]
    cb = GradWatchCallback(config=CFG, print_summary=False, **cb_kw)
    trainer(tmp_path, cb, **kw()).fit(make(ghost), loader())
    return cb


@pytest.mark.parametrize("mode", list(MODES))
def test_clean_model_has_no_findings(tmp_path: Path, mode: str) -> None:
    _skip_unsupported(mode)
    cb = _fit(tmp_path, mode, ghost=False)
    report = cb.report
    assert report is not None
    assert problems(report) == []
    assert report.steps + report.skipped_steps == MODES[mode][2]  # fp16: the scaler may skip
    assert report.backward_passes >= report.steps
    assert cb.watcher is None  # closed at fit end


@pytest.mark.parametrize("mode", list(MODES))
def test_ghost_layer_is_caught(tmp_path: Path, mode: str) -> None:
    _skip_unsupported(mode)
    cb = _fit(tmp_path, mode, ghost=True)
    report = cb.report
    assert report is not None
    prefix = "g_ghost" if mode.startswith("gan") else "ghost"
    expected = {f"{prefix}.weight", f"{prefix}.bias"}
    assert ghost_params(report) == expected
    (finding,) = report.by_check("ghost_param")
    assert finding.severity == "error" and finding.details["cause"] == "not_called"
    assert finding.count == finding.details["steps_missing"] >= 1  # every step, one finding
    assert report.failed
    assert [f for f in report.failing() if f.check != "ghost_param"] == []


def test_accumulation_steps_and_backwards(tmp_path: Path) -> None:
    cb = _fit(tmp_path, "accumulate_grad_batches", ghost=False)
    assert cb.report is not None
    assert (cb.report.steps, cb.report.backward_passes) == (4, 12)


def test_manual_optimization_without_zero_grad_is_caught(tmp_path: Path) -> None:
    cb = GradWatchCallback(config=CFG, print_summary=False)
    trainer(tmp_path, cb).fit(ManualRegressor(zero_grad=False), loader())
    report = cb.report
    assert report is not None
    (finding,) = report.by_check("missing_zero_grad")
    assert finding.severity == "error"
    assert set(finding.params) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}
    assert finding.first_step == 1  # the first step had nothing stale to consume
    assert report.by_check("ghost_param") == []


def test_gan_ghost_names_its_optimizer(tmp_path: Path) -> None:
    cb = _fit(tmp_path, "gan_two_optimizers", ghost=True)
    assert cb.report is not None
    (finding,) = cb.report.by_check("ghost_param")
    assert finding.details["optimizer"] == 0  # the generator's
    assert cb.report.coverage.optimizers == 2


def test_fp16_gradscaler_skipped_steps_are_info_not_errors(tmp_path: Path) -> None:
    """A huge initial scale overflows the first fp16 backwards: the scaler skips those steps."""
    if not _fp16_cpu_supported():
        pytest.skip("torch on this machine has no float16 autocast/GradScaler on CPU")
    cb = GradWatchCallback(config=CFG, print_summary=False)
    plugin = _fp16_cpu_plugin(init_scale=2.0**24)
    t = trainer(tmp_path, cb, plugins=[plugin], max_steps=16, limit_train_batches=8)
    t.fit(Regressor(), loader())
    report = cb.report
    assert report is not None
    assert report.skipped_steps >= 1 and report.steps >= 1
    assert report.steps + report.skipped_steps == t.global_step
    assert problems(report) == []
    assert {f.severity for f in report.by_check("nonfinite_grad")} == {"info"}


def test_16_mixed_flag_on_cpu_behaviour(tmp_path: Path) -> None:
    """Lightning 2.6 maps precision='16-mixed' on CPU to bf16-mixed (no GradScaler): say so."""
    cb = GradWatchCallback(config=CFG, print_summary=False)
    with pytest.warns(UserWarning, match="fp16 is not supported on CPU"):
        t = trainer(tmp_path, cb, precision="16-mixed")
    if t.precision != "bf16-mixed":  # a future Lightning may run real fp16 on CPU
        pytest.skip(f"Lightning {t.precision=}: covered by the GradScaler plugin test")
    t.fit(Regressor(ghost=True), loader())
    assert cb.report is not None and ghost_params(cb.report) == {"ghost.weight", "ghost.bias"}


def test_report_file_and_summary_on_rank_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cb = GradWatchCallback(config=CFG)
    trainer(tmp_path, cb).fit(Regressor(ghost=True), loader())
    path = tmp_path / "gradwatch-report.json"
    assert cb.report_path == path
    on_disk = gradwatch.Report.read(path)
    assert on_disk.model_dump() == cb.report.model_dump()  # type: ignore[union-attr]
    out = capsys.readouterr().out
    assert "gradwatch: FAILED" in out and "ghost_param" in out


def test_print_summary_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cb = GradWatchCallback(config=CFG, print_summary=False, report_name=None)
    trainer(tmp_path, cb).fit(Regressor(ghost=True), loader())
    assert "gradwatch:" not in capsys.readouterr().out
    assert cb.report_path is None and not (tmp_path / "gradwatch-report.json").exists()
    assert cb.report is not None and cb.report.failed


def test_config_from_path_and_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("fail_on: warning\nevery_n_steps: 3\n")
    assert GradWatchCallback(config=str(path)).config.every_n_steps == 3
    with pytest.raises(gradwatch.ConfigError, match="every_n_step"):
        GradWatchCallback(config={"every_n_step": 3})


def test_import_gradwatch_does_not_import_lightning() -> None:
    code = (
        "import sys, gradwatch; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_lightning_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['pytorch_lightning'] = None; sys.modules['lightning'] = None\n"
        "try:\n    import gradwatch.lightning\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    assert "pip install gradwatch[lightning]" in out


def test_example_lightning_ghost_runs(run_example: RunExample) -> None:
    done = run_example("lightning_ghost.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gradwatch: FAILED" in done.stdout
    assert "ghost: aux_head.weight, aux_head.bias (cause: disconnected)" in done.stdout
