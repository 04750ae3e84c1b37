"""``replica_divergence`` evidence: each parameter's exact bit checksum on every rank.

Data-parallel replicas (DDP) must hold bit-identical parameters at every step: DDP
averages the gradients with one all-reduce whose result is the same on every rank, and the
optimizer then applies the same update to the same values. On observed steps the pipeline
already takes, before the optimizer step, an exact checksum of every parameter (the sum of
its bit patterns, ``gradwatch.measure.fingerprint``) for the update ratio; those checksums
ride on the ``all_gather`` the step makes anyway (``DistSync.exchange``), so the comparison
costs no extra pass over the parameters: 8 bytes per parameter tensor per rank. A parameter
whose checksum is not the same on every rank has drifted apart by the start of that step.

Sharded engines: under FSDP2 the checksums are the local shards'; ranks that hold the same
shard (the replicate dimension of an HSDP mesh: ``fully_shard(m, mesh=...)`` with a
``Replicate()`` placement) are compared with each other only, never with ranks holding other
shards; a mesh with no replicate dimension (plain FSDP2) has nothing to compare and sends
nothing more. FSDP1 is not compared (its replicate group is not in reach of the watched
module): its ``not_observed`` info (``fsdp1_replicas``) says so.

One more int64 per optimizer rides along: the step count of its first parameter holding
state. Replicas diverging while those counts differ point at the optimizer's state (only
some ranks loaded it), which the finding's hint then names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gradwatch.capture.facts import REPLICAS_DIFFER, Fact, Report
from gradwatch.capture.grads.window import Track
from gradwatch.model.engines import FSDP2
from gradwatch.model.index import ParamIndex

__all__ = ["Local", "ReplicaCheck"]

_NAMED = 8  # parameters named in the message
_NO_STATE = -1  # an optimizer step count that is not known (no state yet, none read)


@dataclass
class Local:
    """This rank's contribution: the checksums (int64, on the device), whose they are, and
    for each column the lowest rank each rank must equal (``None``: rank 0, as under DDP)."""

    sums: torch.Tensor
    ids: list[int]
    rep: Optional[torch.Tensor] = None
    """``world`` x columns: the rank whose value each rank's must equal (itself: none)."""


def _replica_key(p: torch.Tensor, world: int, cache: dict[Any, tuple[int, ...]]) -> tuple[int, ...]:
    """For each rank, the lowest rank holding the same local values of DTensor ``p``
    (itself when it shares them with none): its coordinates on the mesh's non-replicated
    dimensions say which shard it holds."""
    mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
    key = (id(mesh), placements)
    got = cache.get(key)
    if got is not None:
        return got
    layout = mesh.mesh
    sharded = [d for d, pl in enumerate(placements) if not pl.is_replicate()]
    first: dict[tuple[int, ...], int] = {}
    rep = list(range(world))
    for r in range(world):
        at = (layout == r).nonzero()
        if at.numel() == 0:
            continue  # a rank outside the mesh holds none of it
        coord = at[0].tolist()
        shard = tuple(coord[d] for d in sharded)
        rep[r] = first.setdefault(shard, r)
    cache[key] = tuple(rep)
    return cache[key]


def _optimizer_step(track: Track, device: torch.device) -> torch.Tensor:
    """The step count of ``track``'s optimizer's first parameter holding state (int64)."""
    opt = track.ref() if track.ref is not None else None
    state = getattr(opt, "state", None)
    if isinstance(state, dict):
        for p in track.params:
            st = state.get(p)
            if st and "step" in st:
                v = st["step"]
                if isinstance(v, torch.Tensor):
                    if v.device.type == "cpu":  # a host read costs nothing here
                        return torch.tensor([int(v.item())], dtype=torch.int64, device=device)
                    return v.detach().reshape(1).to(device, torch.int64)
                return torch.tensor([int(v)], dtype=torch.int64, device=device)
    return torch.tensor([_NO_STATE], dtype=torch.int64, device=device)


class ReplicaCheck:
    """This rank's checksums for the exchange, and the verdict on every rank's."""

    def __init__(self, index: ParamIndex, record: Report) -> None:
        self.index = index
        self.record = record
        self.world = 1  # set by the exchange (DistSync) before each local()
        self.first_step: Optional[int] = None
        self._keys: dict[Any, tuple[int, ...]] = {}
        self._reps: dict[int, tuple[list[torch.Tensor], Optional[torch.Tensor]]] = {}

    def local(self, track: Track, world_size: int) -> Optional[Local]:
        """The checksums of ``track``'s pre-step fingerprint as one int64 vector (on the
        device, no sync) and the parameter id of each; ``None``: nothing to compare."""
        self.world = world_size
        fp = track.fingerprint
        if fp is None or track.sharded not in (None, FSDP2):
            return None  # not an observed step, or FSDP1 (its not_observed info says so)
        rep: Optional[torch.Tensor] = None
        if track.sharded == FSDP2:  # compare ranks holding the same shard only
            rep = self._rep(track)
            if rep is None:
                return None  # no replicas (plain FSDP2): nothing to compare
        plan = fp.plan
        device = plan.device
        # One slot per parameter in the track's order, whatever the plan: ranks holding
        # shards of other sizes (an empty one, a small one grouped) have other plans, and
        # the all_gather needs the same length everywhere (0: a tensor with no checksum).
        parts = [c.reshape(-1).to(device, torch.int64) for c in fp.checksums]
        parts.append(torch.zeros(len(plan.skipped), dtype=torch.int64, device=device))
        ordered = torch.cat(parts)[plan.order.to(device)]
        sums = torch.cat([ordered, _optimizer_step(track, device)])
        return Local(sums, [*track.ids, -1], rep)

    def _rep(self, track: Track) -> Optional[torch.Tensor]:
        """``world`` x (columns + 1): the rank each rank's checksum must equal (the last
        column: the optimizer's step count, the same on every rank); ``None``: no replicas.
        Read once per parameter list (a layout change makes a new one)."""
        got = self._reps.get(id(track))
        if got is not None and got[0] is track.params:
            return got[1]
        keys = [self._key(p) for p in track.params]
        rep: Optional[torch.Tensor] = None
        if any(k[r] != r for k in keys for r in range(self.world)):
            rows = [[k[r] for k in keys] + [0] for r in range(self.world)]
            rep = torch.tensor(rows, dtype=torch.int64)
        self._reps[id(track)] = (track.params, rep)
        return rep

    def _key(self, p: torch.Tensor) -> tuple[int, ...]:
        if not hasattr(p, "device_mesh") or not hasattr(p, "placements"):
            return tuple(range(self.world))  # a plain tensor under FSDP2: not compared
        return _replica_key(p, self.world, self._keys)

    def judge(self, local: Local, sums: torch.Tensor, step: int) -> None:
        """``sums``: per rank (rows), the checksums of ``local.ids`` at the start of
        ``step``; record a fact where replicas differ (only those columns reach Python)."""
        ids, world, rep = local.ids, sums.shape[0], local.rep
        base = sums[0].expand_as(sums) if rep is None else sums.gather(0, rep)
        columns = (sums != base)[:, :-1].any(dim=0).nonzero().flatten().tolist()
        if not columns:
            return
        differ: list[int] = []
        odd: set[int] = set()
        for k in columns:
            values = sums[:, k].tolist()
            owner = [0] * world if rep is None else rep[:, k].tolist()
            for group in {owner[r] for r in range(world)}:
                ranks = [r for r in range(world) if owner[r] == group]
                odd.update(_odd([values[r] for r in ranks], ranks))
            differ.append(ids[k])
        if self.first_step is None:
            self.first_step = step
        steps = sums[:, -1].tolist()
        known = {s for s in steps if s != _NO_STATE}
        self._record(differ, sorted(odd), step, steps if len(known) > 1 else None)

    def _record(
        self, differ: list[int], ranks: list[int], step: int, opt_steps: Optional[list[int]]
    ) -> None:
        names = self.index.names(differ)
        shown = ", ".join(names[:_NAMED]) + (
            f" +{len(names) - _NAMED} more" if len(names) > _NAMED else ""
        )
        hint = (
            "Every rank must apply the same update: no rank-conditional or "
            "rank-seeded in-place edits of parameters, and the last micro-batch of a "
            "no_sync() accumulation must run its backward outside no_sync()."
        )
        details: dict[str, Any] = {"ranks": ranks, "first_step": self.first_step}
        details["differ"] = len(names)
        if opt_steps is not None:
            hint = (
                f"The optimizer's step counts differ across ranks ({opt_steps}): its state "
                "was loaded on some ranks only (or some ranks skipped steps). Load "
                "optimizer.state_dict() on every rank."
            )
            details["optimizer_steps"] = opt_steps
        self.record(
            Fact(
                REPLICAS_DIFFER,
                step=step,
                key="replicas",
                message=f"{len(names)} parameter(s) differ across data-parallel ranks {ranks} "
                f"at step {step} (first at step {self.first_step}): {shown}.",
                hint=hint,
                params=names,
                details=details,
            )
        )


def _odd(values: list[int], ranks: list[int]) -> list[int]:
    """The ranks of a replica group whose value is not the group's majority (all on a tie)."""
    counts = Counter(values)
    if len(counts) == 1:
        return []
    common, count = counts.most_common(1)[0]
    tie = sum(1 for c in counts.values() if c == count) > 1
    return [r for r, v in zip(ranks, values) if tie or v != common]
