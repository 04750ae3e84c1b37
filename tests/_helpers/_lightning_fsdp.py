"""``python tests/_helpers/_lightning_fsdp.py OUT SCENARIO``: Lightning + FSDP2 on 2 CPU ranks (gloo).

Lightning's ``strategy="fsdp"`` (FSDP1) refuses a CPU accelerator; its
``ModelParallelStrategy`` shards with FSDP2 (``fully_shard`` in ``configure_model``) and runs
on CPU. Lightning's launcher re-runs this script for rank 1; each rank writes
``OUT/rank<r>.json`` (its report, gradwatch warnings, the error that ended fit).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

STEPS = 3
WORLD = 2


def main(out: Path, scenario: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import lightning.pytorch as pl
    from _dist_helpers import fit_and_record
    from _lightning_helpers import DIM, loader
    from lightning.pytorch.strategies import ModelParallelStrategy

    from gradwatch.lightning import GradWatchCallback

    torch.set_num_threads(1)

    class Sharded(pl.LightningModule):
        def __init__(self, ghost: bool) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 8))
            self.head = nn.Linear(8, 1)
            self.dead = nn.Linear(8, 8) if ghost else None  # built, never called

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            # training_step calls the submodules, not self.forward: each is its own unit
            for mod in (self.encoder, self.head, self.dead):
                if mod is not None:
                    fully_shard(mod, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(torch.tanh(self.encoder(x))), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    cb = GradWatchCallback(config={"every_n_steps": 1, "console": False})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_steps=STEPS,
        limit_train_batches=STEPS,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[cb],
    )
    data = loader(n=48, batch=4, seed=trainer.global_rank)
    fit_and_record(trainer, cb, Sharded(scenario == "ghost"), data, out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: _lightning_fsdp.py OUT_DIR SCENARIO")
    main(Path(sys.argv[1]), sys.argv[2])
