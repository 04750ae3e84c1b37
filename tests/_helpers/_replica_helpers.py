"""Multi-process scenarios for tests/distributed/test_replica_divergence.py (2 gloo ranks).

Each scenario runs a plain DDP loop under ``watch()`` through ``_dist_helpers._run`` (each
rank writes ``<scenario>.rank<r>.json``): three ways replicas drift apart, and DDP variants
that keep them bit-identical, and
an optimizer state loaded on one rank only.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from _dist_helpers import Plain, _data, _run, join_gloo
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

STEPS = 4

Edit = Callable[[nn.Module, int, int], None]  # (module, rank, step), before opt.step()


def _build(**kw: Any) -> Callable[[], tuple[nn.Module, nn.Module, torch.optim.Optimizer]]:
    def build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Plain()
        hook = kw.pop("hook", None)
        zero = kw.pop("zero", False)
        adam = kw.pop("adam", False)
        ddp = DistributedDataParallel(model, **kw)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        if zero:
            with warnings.catch_warnings():  # its import scripts a function: a deprecation
                warnings.simplefilter("ignore", DeprecationWarning)
                from torch.distributed.optim import ZeroRedundancyOptimizer
            opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9
            )
        elif adam:
            opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        return model, ddp, opt

    return build


def _loop(rank: int, edit: Edit | None = None, sync: str = "always", amp: bool = False) -> Any:
    def body(ddp: nn.Module, opt: torch.optim.Optimizer) -> None:
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(2):
                x, y = _data(rank, 10 * step + micro)
                last = micro == 1
                outside = sync == "always" or (sync == "last" and last)
                ctx = ddp.no_sync() if not outside else _null()  # type: ignore[operator]
                with ctx:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                        loss = nn.functional.mse_loss(ddp(x).float(), y)
                    loss.backward()
            if edit is not None:
                edit(ddp.module, rank, step)  # type: ignore[arg-type]
            opt.step()

    return body


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _rank_conditional(model: nn.Module, rank: int, step: int) -> None:
    if rank == 1 and step == 1:  # a weight edit guarded by the rank
        with torch.no_grad():
            model.b.weight.mul_(0.999)  # type: ignore[operator]


def _rank_rng(model: nn.Module, rank: int, step: int) -> None:
    if step == 2:  # noise from each rank's own generator, written in place
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            w = model.a.weight
            w.add_(1e-4 * torch.randn(w.shape, generator=g))  # type: ignore[union-attr]


def _half_loaded(rank: int) -> Any:
    """A resume whose optimizer state only rank 0 loads: rank 1's Adam starts fresh."""

    def body(ddp: nn.Module, opt: torch.optim.Optimizer) -> None:
        if rank == 0:  # the checkpoint of an earlier run of two steps, loaded on rank 0 only
            earlier = torch.optim.Adam([torch.zeros_like(p) for p in ddp.parameters()], lr=1e-2)
            for p in earlier.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            earlier.step()
            earlier.step()
            opt.load_state_dict(earlier.state_dict())
        _loop(rank)(ddp, opt)

    return body


SCENARIOS: dict[str, tuple[dict[str, Any], Callable[[int], Any]]] = {
    "rank_conditional": ({}, lambda r: _loop(r, _rank_conditional)),
    "rank_rng": ({}, lambda r: _loop(r, _rank_rng)),
    "no_sync_never_synced": ({}, lambda r: _loop(r, sync="never")),
    "optimizer_half_loaded": ({"adam": True}, _half_loaded),
    "clean_no_sync_last": ({}, lambda r: _loop(r, sync="last")),
    "clean_static_graph": ({"static_graph": True}, lambda r: _loop(r)),
    "clean_fp16_hook": ({"hook": default_hooks.fp16_compress_hook}, lambda r: _loop(r)),
    "clean_bf16_autocast": ({}, lambda r: _loop(r, amp=True)),
    "clean_zero": ({"zero": True}, lambda r: _loop(r)),
}


def replica_worker(rank: int, port: int, out: str) -> None:
    """One rank of every scenario (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    try:
        for name, (kw, body) in SCENARIOS.items():
            _run(Path(out), name, rank, _build(**dict(kw)), {}, body(rank))
    finally:
        dist.destroy_process_group()
