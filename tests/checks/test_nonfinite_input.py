"""``nonfinite_grad`` ``phase: input``: the NaN/Inf arrives with the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _regime import DIM, LossOf, hf_train
from torch import nn

import gradwatch
from gradwatch.checks.nonfinite import NonfiniteGrad

ID = NonfiniteGrad.id


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))


def _run(model: nn.Module, batches: list[tuple[Any, torch.Tensor]], call: Any = None) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        for x, y in batches:
            opt.zero_grad()
            out = call(model, x) if call is not None else model(x)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
    return w.report()


def test_missing_values_read_as_nan_from_a_table() -> None:
    """A CSV column with empty cells: ``pd.read_csv`` gives NaN, the loader passes it on."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randn(16, DIM, generator=g)
        x[3, 5] = float("nan")
        batches.append((x, torch.randn(16, 1, generator=g)))
    (f,) = _run(_mlp(), batches).by_check(ID)
    assert f.details["phase"] == "input" and f.details["input"] == "args[0]"
    assert f.details["origin_module"] == "0" and f.module == "0"
    assert "arrives with the data" in f.message


def test_normalised_by_a_zero_standard_deviation() -> None:
    """A constant feature standardised with its own std (0): inf and NaN in the batch."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(64, DIM, generator=g)
    raw[:, 2] = 1.0
    x = (raw - raw.mean(0)) / raw.std(0)  # 0/0 in column 2
    model = nn.Sequential(nn.Sequential(nn.Linear(DIM, 16), nn.Tanh()), nn.Linear(16, 1))
    (f,) = _run(model, [(x[:16], torch.randn(16, 1))] * 3).by_check(ID)
    assert f.details["phase"] == "input" and f.details["origin_module"] == "0.0"


class KeywordModel(nn.Module):
    """Called with keywords, as Hugging Face models are (``pixel_values=...``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, *, pixel_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(pixel_values * mask)))


def test_a_keyword_argument_holding_inf() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, DIM, generator=g)
    x[0, 0] = float("inf")  # a pixel decoded as inf from a broken image
    mask = torch.ones(16, DIM)

    def call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=x, mask=mask)

    (f,) = _run(KeywordModel(), [(x, torch.randn(16, 1))] * 3, call).by_check(ID)
    assert f.details["phase"] == "input" and f.details["input"] == "pixel_values"
    assert f.details["origin_module"] == "proj"


def test_a_nan_born_in_the_model_is_still_forward() -> None:
    """Finite data, a normaliser dividing by a zero norm: phase forward, not input."""

    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / x.norm(dim=1, keepdim=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), Norm(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every unit dead: a zero norm
    (f,) = _run(model, [(torch.randn(16, DIM), torch.randn(16, 1))] * 3).by_check(ID)
    assert f.details["phase"] == "forward" and f.details["origin_module"] == "2"


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_nan_in_a_batch(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gradwatch.lightning import GradWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(32, DIM)
    x[::8, 1] = float("nan")
    cb = GradWatchCallback(print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Module(), DataLoader(TensorDataset(x, torch.randn(32, 1)), batch_size=8))
    assert cb.report is not None
    (f,) = cb.report.by_check(ID)
    assert f.details["phase"] == "input" and f.details["origin_module"] == "net.0"


def test_hf_trainer_batch_with_missing_values(tmp_path: Path) -> None:
    """The HF Trainer calls ``model(**batch)``: the argument is named by its keyword."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (f,) = hf_train(LossOf(_mlp()), tmp_path, nan_rows=True).by_check(ID)
    assert f.details["phase"] == "input" and f.details["input"] == "x"
    assert f.details["origin_module"] == "net.0"
