"""Per-rank facts under ``torch.distributed``, exchanged with one ``all_gather`` per step.

What the mechanisms give us under DDP (torch 2.x, gloo and nccl alike):

- a parameter's hooks fire on a rank only when *that rank's* backward reached it; a
  parameter unused on one rank still gets the averaged ``.grad`` from DDP's reducer there,
  with no hook firing. So the local hooks, not ``.grad``, tell which rank missed it.
- by the time ``optimizer.step()`` runs, DDP has averaged ``.grad`` across ranks: gradient
  norms read at the step are already the global ones, the same on every rank, and need no
  collective of their own.

So the one collective per step carries, per parameter, a byte: 0 when its gradient arrived
on this rank, else 1 + the local cause code (why it did not: never called, ran under
no_grad, disconnected). Every rank then knows who missed what and why, and the ghost check
can name the ranks. On observed steps, when ``replica_divergence`` is enabled, the same
collective also carries each parameter's checksum (``replicas.py``; then int64 instead
of one byte per parameter; under HSDP 8 more bytes per parameter next to the shard sums).
Every rank must call ``watch()`` (DDP already demands identical
models): a rank that does not step would leave the others waiting in the collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from gradwatch.capture.grads.evidence import Tracker
    from gradwatch.capture.grads.window import Track
    from gradwatch.distributed.replicas import ReplicaCheck

__all__ = ["CAUSES", "DistSync", "Exchanged"]

CAUSES = ("not_called", "no_grad", "disconnected", "unknown")


@dataclass
class Exchanged:
    """One step's cross-rank view, aligned with the step's parameter ids."""

    ranks_missing: list[list[int]]
    """For each parameter, the ranks where no gradient arrived (same list on every rank)."""
    arrived: list[bool]
    """A gradient arrived on at least one rank (so ``.grad`` holds DDP's average)."""
    cause: Callable[[int], str]
    """Why a parameter was missing, as seen by the lowest rank that missed it."""
    payload: Optional[list[list[float]]] = None
    """Sharded engines: every rank's shard values (``distributed/sharded.py``), same collective."""


class DistSync:
    """Exchanges which parameters each rank saw a gradient for, and why not."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.replicas: Optional[ReplicaCheck] = None  # set when replica_divergence runs

    @classmethod
    def detect(cls) -> Optional[DistSync]:
        """A sync object when a process group of more than one rank is initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        return cls(dist.get_rank(), world) if world > 1 else None

    def _gather(self, codes: list[int], device: Optional[torch.device]) -> list[list[int]]:
        """``codes`` of every rank, as a ``world_size`` x ``len(codes)`` matrix."""
        if dist.get_backend() == "nccl" and device is not None and device.type == "cuda":
            where = device
        else:
            where = torch.device("cpu")
        local = torch.tensor(codes, dtype=torch.uint8, device=where)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu().tolist()  # type: ignore[no-any-return]

    def _gather_float(
        self, values: list[float], device: Optional[torch.device]
    ) -> list[list[float]]:
        """``values`` of every rank (float32: the codes stay exact, the sums were float32)."""
        where = device if dist.get_backend() == "nccl" and device is not None else None
        local = torch.tensor(values, dtype=torch.float32, device=where or torch.device("cpu"))
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu().tolist()  # type: ignore[no-any-return]

    def _gather_sums(
        self, codes: list[int], sums: torch.Tensor, device: Optional[torch.device]
    ) -> torch.Tensor:
        """``codes`` and the parameters' checksums of every rank (int64, exact, on the CPU)."""
        where = device if dist.get_backend() == "nccl" and device is not None else None
        where = where or torch.device("cpu")
        local = torch.cat([torch.tensor(codes, dtype=torch.int64, device=where), sums.to(where)])
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def _gather_mixed(
        self, values: list[float], sums: torch.Tensor, device: Optional[torch.device]
    ) -> tuple[list[list[float]], torch.Tensor]:
        """``values`` (float32) and ``sums`` (int64, exact) of every rank, as one byte
        vector per rank: still the step's one ``all_gather``."""
        where = device if dist.get_backend() == "nccl" and device is not None else None
        where = where or torch.device("cpu")
        exact = sums.to(where).view(torch.uint8)  # first: the int64 part stays 8-aligned
        floats = torch.tensor(values, dtype=torch.float32, device=where).view(torch.uint8)
        local = torch.cat([exact, floats])
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        both = torch.stack(gathered).cpu()
        cut = exact.numel()
        full = both[:, cut:].contiguous().view(torch.float32).tolist()
        return full, both[:, :cut].contiguous().view(torch.int64)

    def exchange(
        self,
        ids: list[int],
        arrived: list[bool],
        cause: Callable[[int], str],
        tracker: Tracker,
        device: Optional[torch.device],
        payload: Optional[list[float]] = None,
        step: int = 0,
        track: Optional[Track] = None,
    ) -> Exchanged:
        """Share this step's arrivals and causes with every rank (one ``all_gather``).

        Also makes ``tracker``'s seen/missing step counters global: a step where any rank
        missed a parameter counts as missing for it, so every rank reports the same
        ``steps_missing``/``steps_seen`` (rank 0, which reports, may itself have had it).
        Under sharding, ``payload`` (this rank's shard sums) rides on the same ``all_gather``;
        on observed steps, ``track``'s pre-step checksums for :attr:`replicas` too (under
        sharding only where ranks hold the same shard: the replicate dimension of HSDP).
        """
        n = len(ids)
        if n == 0:  # same parameters on every rank, so every rank skips the collective
            return Exchanged([], [], cause)
        codes = [0 if a else 1 + _code(cause(i)) for i, a in zip(ids, arrived)]
        rows: Optional[list[list[float]]] = None
        check = self.replicas if track is not None else None
        local = (
            check.local(track, self.world_size) if check is not None and track is not None else None
        )
        if payload is not None:  # sharded: the shard sums, and HSDP replicas' checksums
            values = [float(c) for c in codes] + payload
            if check is not None and local is not None:
                full, exact = self._gather_mixed(values, local.sums, device)
                check.judge(local, exact, step)
            else:
                full = self._gather_float(values, device)
            matrix = [[int(v) for v in row[:n]] for row in full]
            rows = [row[n:] for row in full]
        elif check is not None and local is not None:
            both = self._gather_sums(codes, local.sums, device)
            matrix = both[:, :n].tolist()
            check.judge(local, both[:, n:], step)
        else:
            matrix = self._gather(codes, device)
        world = range(self.world_size)
        ranks = [[r for r in world if matrix[r][k]] for k in range(n)]
        remote: dict[int, str] = {}
        for k, i in enumerate(ids):
            if not ranks[k]:
                continue
            remote[i] = CAUSES[min(matrix[ranks[k][0]][k] - 1, len(CAUSES) - 1)]
            if arrived[k]:  # arrived here but not everywhere: a missing step, globally
                tracker.seen[i] -= 1
                tracker.missing[i] += 1

        def global_cause(i: int) -> str:
            return remote.get(i) or cause(i)

        return Exchanged(ranks, [len(r) < self.world_size for r in ranks], global_cause, rows)

    def ranks_missing(self, arrived: list[bool], device: Optional[torch.device]) -> list[list[int]]:
        """For each parameter, the ranks where no gradient arrived (one ``all_gather``)."""
        if not arrived:
            return []
        matrix = self._gather([0 if a else 1 for a in arrived], device)
        return [[r for r in range(self.world_size) if matrix[r][k]] for k in range(len(arrived))]


def _code(cause: str) -> int:
    try:
        return CAUSES.index(cause)
    except ValueError:
        return CAUSES.index("unknown")
