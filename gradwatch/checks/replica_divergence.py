"""``replica_divergence``: parameters that data-parallel replicas must hold identical differ.

Under DDP every rank applies the same averaged gradient to the same values, so the
replicas stay bit-identical. On observed steps each rank's per-parameter exact bit
checksums ride on the one ``all_gather`` gradwatch makes anyway
(``gradwatch/distributed/replicas.py``); a ``replicas_differ`` fact names the parameters,
the ranks and the first step they differed. Mixed precision, gradient accumulation
(``no_sync`` with a final synchronising backward), ``static_graph``, ZeRO and fp16/bf16
communication hooks keep the replicas bit-identical and are silent. Under HSDP (FSDP2 on a
``(replicate, shard)`` mesh) the ranks holding the same shard are compared with each other,
never with ranks holding other shards; plain FSDP2 has no replicas; FSDP1 is not compared
(its ``not_observed`` info says so). Where the optimizers' step counts differ across ranks
too, ``details.optimizer_steps`` gives them and the hint names the optimizer state.
"""

from __future__ import annotations

from gradwatch._severity import Severity
from gradwatch.capture.facts import REPLICAS_DIFFER
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc

__all__ = ["ReplicaDivergence", "ReplicaDivergenceConfig"]


class ReplicaDivergenceConfig(CheckConfig):
    """``replica_divergence``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class ReplicaDivergence(Check):
    """On observed steps under DDP or HSDP: every rank's checksums, compared in the step's
    collective among the ranks that must hold the same values."""

    id = "replica_divergence"
    maturity = "stable"
    Config = ReplicaDivergenceConfig
    needs = frozenset({"replica_checksums"})
    facts = frozenset({REPLICAS_DIFFER})
    doc = CheckDoc(
        summary="Parameters that data-parallel replicas must hold identical (DDP, the "
        "replicate dimension of HSDP) differ across ranks: compared by exact bit checksums on "
        "observed steps, inside the one collective gradwatch makes per step.",
        why="Diverged replicas train different models: each rank's gradient is computed on "
        "weights the others do not have, the averaged update fits none of them, and the "
        "checkpoint (saved by rank 0) is not what the other ranks evaluated. Losses look "
        "normal for a long time (BLOOM-176B's replicas drifted for weeks).",
        causes=(
            "A rank-conditional in-place update (`if rank == 0: p.mul_(...)`, a weight "
            "edit or EMA written on one rank only).",
            "A rank-local random number in an in-place op on parameters (noise, "
            "dropout-style masks on weights) with per-rank seeds.",
            "`no_sync()` around every backward of an accumulation, without the final "
            "backward outside it that all-reduces the gradients.",
            "Optimizer state that differs per rank after a bad load (only rank 0 loaded "
            "`optimizer.state_dict()`): `details.optimizer_steps` then differ too.",
        ),
        fix="Apply the same update on every rank: keep parameter edits outside rank "
        "conditions, seed shared randomness identically, run the last micro-batch's "
        "backward outside `no_sync()`, load the optimizer state on every rank.",
        detail="under DDP, parameters differ across data-parallel ranks at the start of an "
        "observed step: the exact bit checksums the step takes anyway before its update (the "
        "update ratio's fingerprint) ride on its one `all_gather` (8 more bytes per parameter "
        "tensor per rank, no extra pass over the parameters, no second collective). Caught: a "
        "rank-conditional in-place update, a rank-seeded random edit of weights, `no_sync()` "
        "around every backward (no synchronising final backward). DDP's own variants stay "
        "bit-identical and silent (`find_unused_parameters`, bucket views, `static_graph`, fp16 "
        "compression hook, bf16 autocast, `no_sync` with a final backward, ZeRO). Under HSDP "
        "(FSDP2 on a `(replicate, shard)` mesh) the ranks holding the same shard are compared, "
        "never ranks holding other shards; plain FSDP2 has no replicas; FSDP1 is not compared "
        "(its `info` `not_observed` says so). An optimizer state loaded on some ranks only is "
        "caught and named (`details.optimizer_steps`: each rank's step count). `params`, "
        "`details.ranks` (the ranks off the majority; all of them on a tie), `details.first_step`",
    )
