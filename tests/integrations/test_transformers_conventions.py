"""The HF callback follows the Trainer's conventions: from ``callbacks=[...]`` its metrics
reach the ``report_to`` loggers at the Trainer's logging steps, the console shows no
per-layer norms, a failed report can fail ``train()``, and warnings point at the user's line.

Real ``transformers.Trainer`` runs on tiny BERTs built from a config (no download), on CPU.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gradwatch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from test_transformers import CLSHead, Tokens, _config  # noqa: E402

from gradwatch.transformers import GradWatchCallback  # noqa: E402

STEPS = 4


def _args(tmp_path: Path, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "logging_steps": 2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer(tmp_path: Path, callbacks: list[Any], **kw: Any) -> Any:
    torch.manual_seed(0)
    return transformers.Trainer(
        model=CLSHead(_config()),
        args=_args(tmp_path, **kw),
        train_dataset=Tokens(),
        callbacks=callbacks,
    )


def test_metrics_reach_the_tensorboard_integration_from_callbacks_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _trainer(tmp_path, [cb], report_to=["tensorboard"])
    trainer.train()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    pooler = "train/gradwatch/grad_norm/bert.pooler.dense"
    assert {pooler, "train/gradwatch/grad_norm_total", "train/gradwatch/findings"} <= tags, tags
    loss_steps = [e.step for e in acc.Scalars("train/loss")]
    assert loss_steps == [2, 4]  # the Trainer's own logging steps
    assert [e.step for e in acc.Scalars("train/gradwatch/grad_norm_total")] == loss_steps
    assert [e.value for e in acc.Scalars(pooler)] == [0.0, 0.0]  # the ghost, a flat 0
    head = [e.value for e in acc.Scalars("train/gradwatch/grad_norm/head")]
    report = cb.report
    assert report is not None
    hist = dict(next(layer for layer in report.layers if layer.name == "head").history)
    # the values of the step just observed: HF's global_step N is gradwatch's step N - 1
    assert head == pytest.approx([hist[1], hist[3]], rel=1e-6)


@pytest.mark.parametrize("tqdm", [False, True], ids=["PrinterCallback", "ProgressCallback"])
def test_console_shows_no_per_layer_norms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tqdm: bool
) -> None:
    seen: list[dict[str, Any]] = []

    class Recorder(transformers.TrainerCallback):  # a logging integration listed first
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _trainer(tmp_path, [Recorder(), cb], disable_tqdm=not tqdm)
    trainer.train()
    out = capsys.readouterr()
    console = out.out + out.err
    assert "'loss'" in console  # the Trainer's own records were printed
    assert "gradwatch/grad_norm_total" in console  # a few summary scalars are shown
    assert "gradwatch/grad_norm/" not in console  # per-layer norms are not
    # ... but the recorder, state.log_history and the report_to loggers have them all
    assert any("gradwatch/grad_norm/bert.pooler.dense" in logs for logs in seen)
    history = [h for h in trainer.state.log_history if "gradwatch/grad_norm/head" in h]
    assert [h["step"] for h in history] == [2, 4]


def test_fail_on_report_raises_from_train(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False, fail_on_report=True)
    trainer = _trainer(tmp_path, [cb])
    with pytest.raises(gradwatch.GhostLayerError, match=r"bert\.pooler\.dense"):
        trainer.train()
    assert cb.report is not None and cb.report.failed and cb.watcher is None
    clean = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False, fail_on_report=True)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(_config())
    transformers.Trainer(
        model=model, args=_args(tmp_path), train_dataset=Tokens(), callbacks=[clean]
    ).train()
    assert clean.report is not None and not clean.report.failed


def _framework_dirs() -> tuple[str, ...]:
    mods = [torch, transformers, accelerate, gradwatch]
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in mods)


def test_hf_warning_points_at_the_users_line(tmp_path: Path) -> None:
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _trainer(tmp_path, [cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradwatch.GradWatchWarning)
        trainer.train()
    ours = [w for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)]
    assert ours, [str(w.message) for w in caught]
    for w in ours:
        assert not w.filename.startswith(_framework_dirs()), w.filename
        assert os.path.abspath(w.filename) == os.path.abspath(__file__)  # trainer.train()


HF_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import torch, transformers
from test_transformers import CLSHead, Tokens, _config
from gradwatch.transformers import GradWatchCallback

torch.manual_seed(0)
args = transformers.TrainingArguments(
    output_dir=sys.argv[1], use_cpu=True, report_to=[], max_steps=4,
    per_device_train_batch_size=4, logging_steps=2, save_strategy="no", disable_tqdm=False,
)
cb = GradWatchCallback(config={{"every_n_steps": 1}})
transformers.Trainer(
    model=CLSHead(_config()), args=args, train_dataset=Tokens(), callbacks=[cb]
).train()
"""


@pytest.mark.slow
def test_summary_prints_after_the_tqdm_bar(tmp_path: Path) -> None:
    """stdout and stderr into one pipe, as a terminal shows them."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(HF_SCRIPT.format(tests=str(Path(__file__).resolve().parent)))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    shown = [part for line in proc.stdout.splitlines() for part in line.split("\r")]
    bar = [i for i, part in enumerate(shown) if "it/s]" in part or "s/it]" in part]
    summary = [i for i, part in enumerate(shown) if "gradwatch: FAILED" in part]
    finding = [i for i, part in enumerate(shown) if "error[ghost_param]" in part]
    assert bar and summary and finding, proc.stdout[-3000:]
    assert max(bar) < min(finding) < min(summary), proc.stdout[-3000:]
    assert not [shown[i] for i in finding if "it/s" in shown[i]]
