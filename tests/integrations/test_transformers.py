"""GradWatchCallback on a real Hugging Face ``Trainer``: tiny BERTs built from a config.

No download: the models are built from a ``BertConfig`` and train on an in-memory dataset,
on the CPU, for a few optimizer steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradwatch.transformers import GradWatchCallback  # noqa: E402

STEPS = 4
BATCH = 4


def _config() -> Any:
    return transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )


class Tokens(torch.utils.data.Dataset):
    """Random token sequences whose label is the parity of the first token."""

    def __init__(self, n: int = 64, length: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 40, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 2}


class CLSHead(nn.Module):
    """A BertModel with a hand-made head on the [CLS] state: BERT's pooler still runs in
    every forward, but its output reaches no loss: a ghost (cause ``disconnected``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.bert = transformers.BertModel(config)  # add_pooling_layer=True by default
        self.head = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        logits = self.head(hidden[:, 0])
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _train(tmp_path: Path, model: nn.Module, cb: Any, **kw: Any) -> Any:
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    return trainer


def test_ghost_pooler_is_found_with_its_cause(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _train(tmp_path, CLSHead(_config()), cb)
    report = cb.report
    assert report is not None
    (ghost,) = report.by_check("ghost_param")
    assert ghost.module == "bert.pooler.dense"
    assert ghost.details["cause"] == "disconnected"
    assert sorted(ghost.params) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    assert report.steps == trainer.state.global_step == STEPS
    assert report.coverage.optimizers == 1  # the optimizer inside accelerate's wrapper
    # the report lands in args.output_dir
    assert cb.report_path == Path(trainer.args.output_dir) / "gradwatch-report.json"
    assert gradwatch.Report.read(cb.report_path).by_check("ghost_param")
    # metrics joined the Trainer's log records; the ghost's norm series is a flat 0
    logged = [h for h in trainer.state.log_history if "gradwatch/grad_norm_total" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    assert [h["gradwatch/grad_norm/bert.pooler.dense"] for h in logged] == [0.0] * STEPS
    assert all(h["gradwatch/grad_norm/head"] > 0 for h in logged)


def test_clean_bert_with_gradient_accumulation_is_silent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(_config())
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False)
    trainer = _train(tmp_path, model, cb, gradient_accumulation_steps=2, max_grad_norm=1.0)
    report = cb.report
    assert report is not None
    assert [f.line() for f in report.findings if f.severity != "info"] == []
    # one step per optimizer update, not per micro-batch: 2 backward passes each
    assert report.steps == trainer.state.global_step == STEPS
    assert report.backward_passes == 2 * STEPS
    assert report.coverage.not_in_optimizer == 0 and not report.failed


def test_bound_trainer_logs_through_trainer_log(tmp_path: Path) -> None:
    """With ``trainer=``, the latest observed metrics go through ``Trainer.log`` (every
    integration) at the Trainer's logging steps."""
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=CLSHead(_config()), args=args, train_dataset=Tokens())
    seen: list[dict[str, float]] = []

    class Spy(transformers.TrainerCallback):  # stands for report_to integrations
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "gradwatch/findings" in logs:
                seen.append({**logs, "step": state.global_step})

    trainer.add_callback(Spy())
    cb = GradWatchCallback(config={"every_n_steps": 2}, trainer=trainer, print_summary=False)
    trainer.add_callback(cb)
    trainer.train()
    assert [s["step"] for s in seen] == [2, 4]  # the logging steps; observed: 0 and 2
    assert all(s["gradwatch/grad_norm/bert.pooler.dense"] == 0.0 for s in seen)
    assert cb.report is not None and cb.report.steps == STEPS


def test_bad_config_fails_at_construction() -> None:
    with pytest.raises(gradwatch.ConfigError, match="every_n_step"):
        GradWatchCallback(config={"every_n_step": 2})
