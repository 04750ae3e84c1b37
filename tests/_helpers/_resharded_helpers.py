"""Checkpoints saved by 2 gloo ranks, for tests/distributed/test_resume_resharded.py to resume
in one process: DDP (``torch.save`` on rank 0) and FSDP2 (``torch.distributed.checkpoint``,
each rank its shards; the gradwatch state from rank 0)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_helpers import _data, join_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwatch

STEPS = 3
CFG = {"every_n_steps": 1}


def parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and scheduler of both runs (same initial weights everywhere)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model: nn.Module, opt: Any, sched: Any, rank: int, steps: int, at: int = 0) -> None:
    for step in range(at, at + steps):
        opt.zero_grad()
        x, y = _data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def _ddp(rank: int, out: Path) -> None:
    model, _, _ = parts()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with gradwatch.watch(ddp, opt, config=CFG) as w:
        train(ddp, opt, sched, rank, STEPS)
        state = w.state_dict(step=STEPS)
    if rank == 0:
        ck = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        torch.save({**ck, "gradwatch": state}, out / "ddp.pt")


def _fsdp2(rank: int, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _, _ = parts()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with gradwatch.watch(model, opt, config=CFG) as w:
        train(model, opt, sched, rank, STEPS)
        state = w.state_dict(step=STEPS)
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():  # DCP's own notices about its planner
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp"))
    if rank == 0:
        torch.save({"sched": sched.state_dict(), "gradwatch": state}, out / "fsdp2.pt")


def save_worker(rank: int, port: int, out: str) -> None:
    """Both checkpoints, saved by 2 ranks (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    try:
        _ddp(rank, Path(out))
        _fsdp2(rank, Path(out))
    finally:
        dist.destroy_process_group()
