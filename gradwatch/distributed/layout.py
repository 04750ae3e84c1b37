"""What gradwatch can and cannot see under each sharding engine: evidence, and facts to judge."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from gradwatch.capture.facts import UNOBSERVABLE, Fact, Report
from gradwatch.distributed import fsdp1_flat
from gradwatch.distributed.fsdp1_reach import OutputReach, reach_of
from gradwatch.distributed.sharded import hook_flat_params, hook_layer_outputs
from gradwatch.model.engines import FSDP1_FLAT, FSDP1_ORIG, engine_of

if TYPE_CHECKING:
    from gradwatch.capture.grads.evidence import Tracker
    from gradwatch.model.index import ParamIndex

__all__ = ["adopt_engine", "forward_arrival", "hook_backward", "late_sharding", "report_layout"]


def adopt_engine(pipe: Any, step: int) -> None:
    """After a layout re-read: the tracks learn the engine; sharding after watch() is said.

    FSDP1 flattened: each flat parameter is replaced by its original parameters (read from
    its metadata, :mod:`gradwatch.distributed.fsdp1_flat`); one it cannot read fails the report.
    """
    if pipe.model is not None:
        late_sharding(pipe.sharded, pipe.model, pipe.record, step)
    if pipe.sharded == FSDP1_FLAT and pipe.model is not None:
        structure = pipe.structure
        index = structure.index
        lay = fsdp1_flat.adopt(pipe.model, index, structure.tracks, pipe.hooks, pipe.flat)
        pipe.tracker.grow(len(index.params))
        if lay.unreadable:
            _flat_unreadable(pipe.record, index, lay.unreadable, step)
    if pipe.sharded in (FSDP1_ORIG, FSDP1_FLAT) and not pipe.hooks.keep_all:
        reach = reach_of(pipe.tracker)
        if reach is None:
            reach = OutputReach(pipe.tracker, pipe.faults.callback())
            pipe.hooks.removers.append(reach.remove)
        reach.cover(pipe.hooks.layers())  # at every layout re-read: new layers too
    for track in pipe.structure.tracks:
        track.sharded = pipe.sharded


def late_sharding(engine: Optional[str], model: nn.Module, report: Report, step: int) -> None:
    """The model was sharded after ``watch()`` began (seen at a layout re-read): say so.

    ``fully_shard`` replaces every parameter with a DTensor: the hooks, and an optimizer
    created before it, still hold the old tensors, which no backward reaches any more.
    """
    if engine is not None or engine_of(model) is None:
        return
    report(
        Fact(
            UNOBSERVABLE,
            step=step,
            key="sharded_after_watch",
            message="The model was sharded (fully_shard / FSDP) after watch() began: gradwatch "
            "(and any optimizer created before sharding) holds the parameters from before.",
            hint="Shard first, then create the optimizer from the sharded model's parameters, "
            "then call watch().",
            details={"reason": "sharded_after_watch"},
        )
    )


def hook_backward(
    engine: Optional[str],
    model: nn.Module,
    flat: Sequence[Callable[[], Optional[torch.Tensor]]],
    add: Callable[[Any], None],
    on_arrival: Callable[[], None],
    on_error: Callable[[str, BaseException], None],
) -> None:
    """FSDP1: mark backward passes from its flat parameters, or (none in reach: the model
    was watched from inside its wrapper, as Lightning does) from the layers' outputs."""
    if engine not in (FSDP1_ORIG, FSDP1_FLAT):
        return
    if flat:
        hook_flat_params(flat, add, on_arrival, on_error)
    else:
        hook_layer_outputs(model, add, on_arrival, on_error)


def forward_arrival(
    engine: Optional[str], index: ParamIndex, tracker: Tracker, start: int
) -> Optional[Callable[[int], bool]]:
    """FSDP1: no hook sees an original parameter's gradient; its module's forward does.

    A parameter counts as arrived when a module owning it ran with gradients enabled since
    event ``start`` and a gradient reached that module's output since then
    (:mod:`gradwatch.distributed.fsdp1_reach`): a ghost whose module never ran, ran under
    ``no_grad``, or ran with an output that never reached the loss (FSDP1 hands it a zero
    slice) is caught. ``None`` (the hooks' evidence holds) for every other engine.
    """
    if engine not in (FSDP1_ORIG, FSDP1_FLAT):
        return None
    params, fwd = index.params, tracker.fwd_grad
    reach = reach_of(tracker)
    if reach is None:

        def ran(i: int) -> bool:
            return any(fwd.get(o, 0) > start for o in params[i].owners)

        return ran

    def arrived(i: int) -> bool:
        return any(fwd.get(o, 0) > start and reach.arrived(o, start) for o in params[i].owners)

    return arrived


def report_layout(
    engine: Optional[str], report: Report, index: ParamIndex, lay: fsdp1_flat.FlatLayout
) -> None:
    """Record what ``engine`` hides from gradwatch (if any), for ``not_observed`` to judge.

    FSDP1 (``use_orig_params`` or flattened): its replicas (``NO_SHARD``, ``HYBRID_SHARD``)
    are not compared (``info``: the other checks run, only that one is out of reach; a
    disconnected ghost is seen from its layer's output, :mod:`.fsdp1_reach`). FSDP1
    flattened whose layout cannot be read: the report fails (the configured severity).
    """
    if engine == FSDP1_FLAT:
        if lay.unreadable or not lay.originals:
            problems = lay.unreadable or {-1: "no flat parameter in the watched model"}
            _flat_unreadable(report, index, problems, 0)
            return
    if engine in (FSDP1_ORIG, FSDP1_FLAT):
        report(
            Fact(
                UNOBSERVABLE,
                step=0,
                key="fsdp1_replicas",
                message="FSDP1: replicas (NO_SHARD, HYBRID_SHARD) are not compared by "
                "replica_divergence (the replicate group is not in reach of the watched model).",
                hint="FSDP2 (torch.distributed.fsdp.fully_shard) on an HSDP mesh (replicate, "
                "shard): gradwatch compares its replicas.",
                details={"reason": "fsdp1_replicas", "engine": engine, "replicas": False},
            )
        )


def _flat_unreadable(
    report: Report, index: ParamIndex, problems: dict[int, str], step: int
) -> None:
    """FSDP1 flattened, a flat parameter whose layout cannot be read: the report fails."""
    params = index.params
    names = [n for i in problems if 0 <= i < len(params) for n in params[i].names]
    fact = Fact(
        UNOBSERVABLE,
        step=step,
        key="fsdp1_flat_params",
        message="FSDP1 with flattened parameters (use_orig_params=False): the layout of "
        f"{len(names)} flat parameter(s) could not be read ({'; '.join(problems.values())}), "
        "so no per-layer check (ghost parameters included) runs on the layers inside them.",
        hint="Wrap with FullyShardedDataParallel(..., use_orig_params=True) or use FSDP2 "
        "(torch.distributed.fsdp.fully_shard): gradwatch then checks every layer.",
        params=names,
        details={
            "reason": "fsdp1_flat_params",
            "engine": FSDP1_FLAT,
            "problems": sorted(set(problems.values())),
        },
    )
    report(fact)
