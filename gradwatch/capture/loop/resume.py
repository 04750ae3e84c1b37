"""``resume_mismatch`` evidence: what a faithful resume must restore, and what it restored.

At checkpoint time (``Watcher.state_dict()``) :func:`snapshot` records, as plain data, the
parameters' exact bit checksums, each optimizer's step counts, a checksum of its moments
(every state tensor but ``step``), its learning rates and its LR schedulers' ``last_epoch``,
and the step counter. At the first optimizer step after ``load_state_dict()`` (before the
step changes anything) :func:`compare` reads the same again and says what differs. Both
read every tensor once with one host transfer per device: a cost at save and at resume
only, never on a training step.

Across world sizes: whole parameters (DDP, one process) compare at any world size; shards
(FSDP) compare only at the same world size on the rank that saved them, and a resume at
another layout (``torch.distributed.checkpoint`` resharding) says, as ``not_observed``
info, that it compares the counters, rates and schedulers only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from gradwatch.capture.facts import RESUMED, UNOBSERVABLE, Fact
from gradwatch.capture.loop.schedulers import _scheduler_states
from gradwatch.measure.checksums import checksums

__all__ = ["compare", "snapshot"]

_MASK = (1 << 32) - 1


def _opt_state(opt: Any) -> dict[str, Any]:
    """One optimizer's step counts, moment checksum, learning rates and schedulers' epochs."""
    steps: list[Any] = []
    moments: list[torch.Tensor] = []
    held = 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            held += 1
            for name in sorted(st):
                v = st[name]
                if name == "step":
                    steps.append(v)
                elif isinstance(v, torch.Tensor):
                    moments.append(v)
    counts = [float(s) for s in _to_host(steps)]
    mixed = sum((k + 1) * c for k, c in enumerate(checksums(moments))) & _MASK
    return {
        "steps": [min(counts), max(counts)] if counts else [0.0, 0.0],
        "held": held,
        "moments": mixed,
        "lrs": [float(g.get("lr", 0.0)) for g in opt.param_groups],
        "schedulers": [int(d["last_epoch"]) for d in _scheduler_states(opt)],
    }


def _to_host(values: list[Any]) -> list[float]:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    moved = iter(torch.stack([t.detach().float().reshape(()).cpu() for t in tensors]).tolist())
    return [next(moved) if isinstance(v, torch.Tensor) else float(v) for v in values]


def snapshot(
    params: Iterable[tuple[str, torch.Tensor]],
    optimizers: list[Any],
    steps: int,
    world_size: int,
    loop_step: Optional[int] = None,
    sharded: bool = False,
) -> dict[str, Any]:
    """What a resume must restore, as plain data (loads with ``weights_only=True``).

    ``sharded``: the parameters are this rank's shards (FSDP), which differ per rank and
    reshard on load: their checksums (and the moments') compare only on a resume at the same
    world size, on the rank that saved them, for shards of the same size.
    """
    named = list(params)
    sums = checksums([p for _, p in named])
    return {
        "steps": steps,
        "loop_step": loop_step,
        "world_size": world_size,
        "rank": _rank(),
        "sharded": sharded or any(hasattr(p, "to_local") for _, p in named),
        "params": {name: c for (name, _), c in zip(named, sums)},
        "numel": {name: _local_numel(p) for name, p in named},
        "optimizers": {str(k): _opt_state(opt) for k, opt in enumerate(optimizers)},
    }


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local_numel(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor: this rank's shard
    return int(local.numel())


def _layout(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """``same``: the checksums compare; ``resharded``: the layout changed, they cannot;
    ``other_rank``: sharded at the same layout, but this rank did not save the state."""
    saved_sh, now_sh = bool(saved.get("sharded")), bool(now.get("sharded"))
    if not saved_sh and not now_sh:  # whole parameters on every rank: any world size
        return "same"
    if saved_sh != now_sh or saved.get("world_size") != now.get("world_size"):
        return "resharded"
    return "same" if saved.get("rank", 0) == now.get("rank", 0) else "other_rank"


def compare(saved: dict[str, Any], now: dict[str, Any], step: int) -> list[Fact]:
    """What the resumed run (``now``, read before its first step) lost of ``saved``."""
    facts: list[Fact] = []
    layout = _layout(saved, now)
    same_world = saved.get("world_size") == now.get("world_size")
    if layout == "same":
        facts += _params(_same_size(saved, now), now["params"], step)
    elif layout == "resharded":
        facts.append(_resharded(saved, now, step))
    for k, old in saved.get("optimizers", {}).items():
        new = now["optimizers"].get(k)
        if new is not None:  # moments: the same state tensors (ZeRO partitions them per rank)
            moments = layout == "same" and (same_world or old["held"] == new["held"])
            facts += _optimizer(k, old, new, step, moments)
    loop_saved, loop_now = saved.get("loop_step"), now.get("loop_step")
    if loop_saved and loop_now is not None and loop_now != loop_saved:
        facts.append(
            Fact(
                RESUMED,
                step=step,
                key="step",
                message=f"resumed at step {loop_now}, but the checkpoint was saved at step "
                f"{loop_saved}: the run restarted its step counter.",
                hint="Restore the training loop's step (global_step) with the checkpoint.",
                details={"aspect": "step", "saved": loop_saved, "resumed": loop_now},
            )
        )
    return facts


def _same_size(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, int]:
    """The saved checksums of the parameters whose local size is the same now (a state of
    an earlier version has no sizes: all of them)."""
    sums: dict[str, int] = saved.get("params", {})
    before, after = saved.get("numel"), now.get("numel", {})
    if before is None:
        return sums
    return {n: c for n, c in sums.items() if before.get(n) == after.get(n)}


def _resharded(saved: dict[str, Any], now: dict[str, Any], step: int) -> Fact:
    """Resumed at another world size or sharding: the checksums of shards cannot compare."""
    was = f"{saved.get('world_size')} rank(s){' sharded' if saved.get('sharded') else ''}"
    is_ = f"{now.get('world_size')}{' sharded' if now.get('sharded') else ''}"
    return Fact(
        UNOBSERVABLE,
        step=step,
        key="resume_resharded",
        message=f"Resumed at another layout (saved at {was}, resumed at {is_}): the "
        "parameters' and the optimizer moments' checksums were taken on shards and cannot be "
        "compared; the optimizer's step counts, the learning rates, the schedulers and the "
        "step counter still are (resume_mismatch).",
        hint="Nothing to fix: a resharded resume (torch.distributed.checkpoint) is "
        "checked on its counters only.",
        details={
            "reason": "resume_resharded",
            "saved": {"world_size": saved.get("world_size"), "sharded": saved.get("sharded")},
            "resumed": {"world_size": now.get("world_size"), "sharded": now.get("sharded")},
        },
    )


def _params(saved: dict[str, int], now: dict[str, int], step: int) -> list[Fact]:
    differ = [n for n, c in saved.items() if n in now and now[n] != c]
    if not differ:
        return []
    share = f"{len(differ)} of {len(saved)}"
    return [
        Fact(
            RESUMED,
            step=step,
            key="params",
            message=f"{share} parameters differ from the checkpointed run's at save time: "
            "the weights loaded are not the ones saved with this state.",
            hint="Load the model's weights from the same checkpoint as the gradwatch state "
            "(another run's or an older checkpoint's weights, or weights never loaded).",
            params=differ,
            details={"aspect": "params", "differ": len(differ), "total": len(saved)},
        )
    ]


def _optimizer(
    k: str, old: dict[str, Any], new: dict[str, Any], step: int, moments: bool
) -> list[Fact]:
    facts: list[Fact] = []

    def fact(aspect: str, message: str, hint: str, saved: Any, resumed: Any) -> None:
        details = {"aspect": aspect, "optimizer": int(k), "saved": saved, "resumed": resumed}
        facts.append(
            Fact(
                RESUMED, step=step, key=f"{aspect}:{k}", message=message, hint=hint, details=details
            )
        )

    if old["held"] and (new["held"] == 0 or new["steps"] != old["steps"]):
        fact(
            "optimizer",
            f"optimizer {k} resumed with step counts {new['steps']} (state for {new['held']} "
            f"parameters), but {old['steps']} ({old['held']}) were saved: a fresh optimizer "
            "after loading the weights.",
            "Save and load optimizer.state_dict() with the model's.",
            old["steps"],
            new["steps"],
        )
    elif moments and old["held"] and new["moments"] != old["moments"]:
        fact(
            "optimizer",
            f"optimizer {k}'s moments differ from the ones saved: its state comes from "
            "another checkpoint.",
            "Load the optimizer's state from the same checkpoint as the model's.",
            old["moments"],
            new["moments"],
        )
    if new["lrs"] != old["lrs"]:
        fact(
            "lr",
            f"optimizer {k} resumed with learning rates {new['lrs']}, but {old['lrs']} were "
            "in use when the checkpoint was saved: the schedule was not restored.",
            "Save and load the LR scheduler's state_dict() (and the optimizer's).",
            old["lrs"],
            new["lrs"],
        )
    elif old["schedulers"] and new["schedulers"] != old["schedulers"]:
        fact(
            "scheduler",
            f"optimizer {k}'s LR scheduler resumed at epoch {new['schedulers']}, but it was "
            f"at {old['schedulers']} when the checkpoint was saved: it restarts the schedule.",
            "Save and load the LR scheduler's state_dict().",
            old["schedulers"],
            new["schedulers"],
        )
    return facts
