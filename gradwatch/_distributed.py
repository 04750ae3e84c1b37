"""Gathering per-rank facts under ``torch.distributed`` (one collective per step)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class DistSync:
    """Exchanges which parameters each rank saw a gradient for."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def detect(cls) -> Optional[DistSync]:
        """A sync object when a process group of more than one rank is initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        return cls(dist.get_rank(), world) if world > 1 else None

    def ranks_missing(self, arrived: list[bool], device: Optional[torch.device]) -> list[list[int]]:
        """For each parameter, the ranks where no gradient arrived (one ``all_gather``)."""
        if dist.get_backend() == "nccl" and device is not None and device.type == "cuda":
            where = device
        else:
            where = torch.device("cpu")
        local = torch.tensor(arrived, dtype=torch.uint8, device=where)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        matrix = torch.stack(gathered).cpu().tolist()
        return [[r for r in range(self.world_size) if not matrix[r][k]] for k in range(len(arrived))]
