"""GradWatchCallback on a LightningModule with a real ghost layer.

The model computes an auxiliary head but its loss is never added to the total, so the
auxiliary head never receives a gradient: it silently stays at its initial weights while
the optimizer "trains" it. gradwatch names it (cause: ``disconnected``) after one step.

Run:
    python examples/lightning_ghost.py
"""

from __future__ import annotations

import tempfile
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradwatch.lightning import GradWatchCallback


class Classifier(pl.LightningModule):
    def __init__(self, aux_weight: float = 0.3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)
        self.aux_head = nn.Linear(32, 3)  # deep supervision: meant to add aux_weight * aux loss
        self.aux_weight = aux_weight

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        h = self.encoder(x)
        loss = nn.functional.cross_entropy(self.head(h), y)
        aux_loss = nn.functional.cross_entropy(self.aux_head(h), y)
        self.log("aux_loss", aux_loss)  # logged, so it looks fine on the dashboard...
        return loss  # ...but `+ self.aux_weight * aux_loss` was forgotten: aux_head is a ghost

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 20, generator=g)
    y = (x[:, :3].argmax(dim=1)).long()
    return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> int:
    warnings.filterwarnings("ignore")  # keep the demo output to the report itself
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        callback = GradWatchCallback(config={"every_n_steps": 5})
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=2,
            logger=pl.loggers.CSVLogger(root),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
        )
        trainer.fit(Classifier(), data())  # the callback prints the summary on rank 0
        report = callback.report
        assert report is not None
        print(f"JSON report: {callback.report_path} (a temporary directory, removed at exit)")
        for finding in report.by_check("ghost_param"):
            print(f"ghost: {', '.join(finding.params)} (cause: {finding.details['cause']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
