"""``probes=True`` on the Lightning callback: once, at fit start, on a copy of the module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from _lightning_helpers import Regressor, loader, trainer

from gradwatch.lightning import GradWatchCallback
from gradwatch.probes import PROBES

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


class LeakyRegressor(Regressor):
    """Its forward normalises over the batch (softmax over dim 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.softmax(x, dim=0))


def _fit(tmp_path: Path, model: Any, probes: bool) -> GradWatchCallback:
    torch.manual_seed(0)
    cb = GradWatchCallback(config={"every_n_steps": 1}, print_summary=False, probes=probes)
    trainer(tmp_path, cb).fit(model, loader())
    return cb


def test_probes_run_once_on_a_copy_and_change_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain, probed = Regressor(), Regressor()
    probed.load_state_dict(plain.state_dict())
    assert _fit(tmp_path / "a", plain, probes=False).probe_report is None
    cb = _fit(tmp_path / "b", probed, probes=True)
    report = cb.probe_report
    assert report is not None and not report.failed
    assert [p.id for p in report.probes] == list(PROBES)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), probed.parameters()))
    assert cb.report is not None and cb.report.steps == 6


def test_a_leak_between_samples_is_found_at_fit_start(tmp_path: Path) -> None:
    report = _fit(tmp_path, LeakyRegressor(), probes=True).probe_report
    assert report is not None and report.failed
    assert [f.check for f in report.failing()] == ["sample_dependence"]


def test_hf_trainer_probes_a_small_bert_at_train_begin(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from gradwatch.transformers import GradWatchCallback as HFCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(1, 40, (32, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 2}

    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    cb = HFCallback(config={"every_n_steps": 1}, print_summary=False, probes=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    report = cb.probe_report
    assert report is not None
    verdicts = {p.id: p.verdict for p in report.probes}
    assert verdicts["sample_dependence"] == "passed" and verdicts["gradient_mismatch"] == "passed"
    assert not report.failed, [f.message for f in report.failing()]
