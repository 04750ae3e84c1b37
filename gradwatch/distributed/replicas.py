"""``replica_divergence`` evidence: each parameter's exact bit checksum on every rank.

Data-parallel replicas (DDP) must hold bit-identical parameters at every step: DDP
averages the gradients with one all-reduce whose result is the same on every rank, and the
optimizer then applies the same update to the same values. On observed steps the pipeline
already takes, before the optimizer step, an exact checksum of every parameter (the sum of
its bit patterns, ``gradwatch.measure.fingerprint``) for the update ratio; those checksums
ride on the ``all_gather`` the step makes anyway (``DistSync.exchange``), so the comparison
costs no extra pass over the parameters: 8 bytes per parameter tensor per rank. A parameter
whose checksum is not the same on every rank has drifted apart by the start of that step.
Sharded engines (FSDP) are not compared: their ranks hold different shards.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from gradwatch.capture.facts import REPLICAS_DIFFER, Fact, Report
from gradwatch.capture.window import Track
from gradwatch.model.index import ParamIndex

__all__ = ["ReplicaCheck"]

_NAMED = 8  # parameters named in the message


class ReplicaCheck:
    """This rank's checksums for the exchange, and the verdict on every rank's."""

    def __init__(self, index: ParamIndex, record: Report) -> None:
        self.index = index
        self.record = record
        self.first_step: Optional[int] = None

    @staticmethod
    def local(track: Track) -> Optional[tuple[torch.Tensor, list[int]]]:
        """The checksums of ``track``'s pre-step fingerprint as one int64 vector (on the
        device, no sync) and the parameter id of each; ``None``: nothing to compare."""
        fp = track.fingerprint
        if fp is None or track.sharded is not None or not fp.checksums:
            return None  # not an observed step, or shards: ranks hold different values
        device = fp.checksums[0].device
        sums = torch.cat([c.reshape(-1).to(device, torch.int64) for c in fp.checksums])
        owners = [p for g in fp.plan.groups for p in g.members]
        owners += [b.position for b in fp.plan.big]
        return sums, [track.ids[p] for p in owners]

    def judge(self, ids: list[int], sums: torch.Tensor, step: int) -> None:
        """``sums``: per rank (rows), the checksums of ``ids`` at the start of ``step``;
        record a fact where they differ (only those columns reach Python)."""
        world = sums.shape[0]
        columns = (sums != sums[0]).any(dim=0).nonzero().flatten().tolist()
        if not columns:
            return
        differ: list[int] = []
        odd: set[int] = set()
        for k in columns:
            values = sums[:, k].tolist()
            if len(set(values)) == 1:
                continue
            differ.append(ids[k])
            common, count = Counter(values).most_common(1)[0]
            tie = sum(1 for c in Counter(values).values() if c == count) > 1
            odd.update(r for r in range(world) if tie or values[r] != common)
        if not differ:
            return
        if self.first_step is None:
            self.first_step = step
        names = self.index.names(differ)
        ranks = sorted(odd)
        shown = ", ".join(names[:_NAMED]) + (
            f" +{len(names) - _NAMED} more" if len(names) > _NAMED else ""
        )
        self.record(
            Fact(
                REPLICAS_DIFFER,
                step=step,
                key="replicas",
                message=f"{len(names)} parameter(s) differ across data-parallel ranks {ranks} "
                f"at step {step} (first at step {self.first_step}): {shown}.",
                hint="Every rank must apply the same update: no rank-conditional or "
                "rank-seeded in-place edits of parameters, and the last micro-batch of a "
                "no_sync() accumulation must run its backward outside no_sync().",
                params=names,
                details={"ranks": ranks, "first_step": self.first_step, "differ": len(names)},
            )
        )
