"""Multi-process scenarios for tests/distributed/test_replicas_sharded.py (2 gloo ranks).

HSDP through FSDP2 (``fully_shard`` on a ``("replicate", "shard")`` mesh of shape (2, 1):
both ranks hold the same shard), plain FSDP2 (a 1-D mesh: each rank its own shard, no
replicas) and FSDP1 ``HYBRID_SHARD`` (a shard group of one rank each, a replicate group of
both); and HSDP on 4 ranks (2 replicas x 2 shards), where only ranks holding the same shard
may be compared. Each rank writes ``<scenario>.rank<r>.json`` through the DDP helpers' runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from _dist_helpers import WORLD, _data, _run, join_gloo
from torch import nn

STEPS = 4
EDITED = "2.weight"  # the parameter rank 1 edits in place
EDIT_AT = 1  # the loop step (0-based) before whose optimizer step it does


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _fsdp2(shape: tuple[int, ...]) -> Callable[[], tuple[nn.Module, nn.Module, Any]]:
    def build() -> tuple[nn.Module, nn.Module, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    return build


def _fsdp1_hybrid() -> tuple[nn.Module, nn.Module, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    model = _model()
    rank = dist.get_rank()
    shard_groups = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates each
    replicate = dist.new_group(list(range(WORLD)))
    wrapped = FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=(shard_groups[rank], replicate),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    return model, wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def _loop(
    rank: int, edit: bool, by: int = 1, name: str = EDITED
) -> Callable[[nn.Module, Any], None]:
    def body(model: nn.Module, opt: Any) -> None:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            if edit and rank == by and step == EDIT_AT:  # this rank's copy of its shard only
                with torch.no_grad():
                    dict(model.named_parameters())[name].to_local().mul_(0.999)
            opt.step()

    return body


SCENARIOS: dict[str, tuple[Callable[[], tuple[nn.Module, nn.Module, Any]], bool]] = {
    "hsdp_rank_edit": (_fsdp2((WORLD, 1)), True),
    "hsdp_clean": (_fsdp2((WORLD, 1)), False),
    "fsdp2_shard_only": (_fsdp2((WORLD,)), False),
    "fsdp1_hybrid": (_fsdp1_hybrid, False),
}


WORLD4 = 4
EDITED4, BY4 = "0.weight", 3  # rank 3 (shard 1 of replica 1) edits its half of 0.weight
SCENARIOS4: dict[str, tuple[Callable[[], tuple[nn.Module, nn.Module, Any]], bool]] = {
    "hsdp4_rank_edit": (_fsdp2((2, 2)), True),
    "hsdp4_clean": (_fsdp2((2, 2)), False),
}
"""HSDP on 4 ranks, mesh [[0, 1], [2, 3]]: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1."""


def hsdp4_worker(rank: int, port: int, out: str) -> None:
    """One of 4 ranks: replicate 2 x shard 2 (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port, world_size=WORLD4)
    try:
        for name, (build, edit) in SCENARIOS4.items():
            _run(Path(out), name, rank, build, {}, _loop(rank, edit, BY4, EDITED4))
    finally:
        dist.destroy_process_group()


def hsdp_worker(rank: int, port: int, out: str) -> None:
    """One rank of every scenario (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    try:
        for name, (build, edit) in SCENARIOS.items():
            _run(Path(out), name, rank, build, {}, _loop(rank, edit))
    finally:
        dist.destroy_process_group()
