"""Multi-process helpers for tests/distributed/test_fsdp.py: 2 CPU ranks on gloo, real FSDP2 and FSDP1.

:func:`sharded_worker` runs under ``torch.multiprocessing.spawn`` and goes through every
scenario in :data:`SCENARIOS`, each rank writing ``<scenario>.rank<r>.json`` (its report,
the gradwatch warnings it emitted, the error that ended it) through the DDP helpers' runner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _dist_helpers import STEPS, WORLD, _data, _run, join_gloo
from torch import nn

ENGINES = ("fsdp2", "fsdp1_orig", "fsdp1_flat", "fsdp1_inner")
"""``fsdp1_inner``: FSDP1 ``use_orig_params=True`` with ``watch()`` given the module inside the
wrapper, as Lightning's callback does (its FSDP strategy wraps the LightningModule)."""

_WRAPPER: dict[str, nn.Module] = {}  # fsdp1_inner: the wrapper the loop must call
SCENARIOS = tuple(f"{e}_{m}" for e in ENGINES for m in ("ghost", "clean"))


class Model(nn.Module):
    """``encoder`` and ``head`` train; ``dead`` (when present) never runs on any rank."""

    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 1)
        self.dead = nn.Linear(8, 8) if dead else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


def _shard(engine: str, model: nn.Module) -> nn.Module:
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        fully_shard(model.encoder, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(
        model, use_orig_params=engine != "fsdp1_flat", device_id=torch.device("cpu")
    )


def _build(engine: str, dead: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # same initial weights on every rank
    model = Model(dead)
    sharded = _shard(engine, model)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    if engine == "fsdp1_inner":
        _WRAPPER["model"] = sharded
        return model, model, opt
    return model, sharded, opt


def _loop(model: nn.Module, opt: torch.optim.Optimizer, rank: int, engine: str, out: Path) -> None:
    if engine == "fsdp1_inner":
        model = _WRAPPER.pop("model")
    before: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = _data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        if step == STEPS - 1 and engine != "fsdp1_flat":
            before = _full_params(model, engine)
        opt.step()
    if engine != "fsdp1_flat":  # no full gradients to read there: tests/_helpers/_flat_helpers.py
        expected = _full_norms(model, engine)
        after = _full_params(model, engine)
        sq: dict[str, list[float]] = {}
        for name, w in after.items():
            acc = sq.setdefault(f"update_ratio:{name.rsplit('.', 1)[0]}", [0.0, 0.0])
            acc[0] += float((w - before[name]).double().norm()) ** 2
            acc[1] += float(w.double().norm()) ** 2
        expected.update({k: (d / p) ** 0.5 for k, (d, p) in sq.items()})
        (out / f"{engine}.expected{rank}.json").write_text(json.dumps(expected))


def _full_params(model: nn.Module, engine: str) -> dict[str, torch.Tensor]:
    """Copies of the full (unsharded) parameters by the user's names (the test's truth)."""
    if engine == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
            if not n.startswith("dead") and ".dead." not in n
        }


def _full_norms(model: nn.Module, engine: str) -> dict[str, float]:
    """Each layer's gradient L2 norm from the full (unsharded) gradients: the test's truth."""
    sq: dict[str, float] = {}
    if engine == "fsdp2":
        for name, p in model.named_parameters():
            if p.grad is not None:
                layer = name.rsplit(".", 1)[0]
                sq[layer] = sq.get(layer, 0.0) + float(p.grad.full_tensor().norm()) ** 2
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            for name, p in model.named_parameters():
                layer = name.rsplit(".", 1)[0].replace("_fsdp_wrapped_module.", "")
                if p.grad is not None and not layer.startswith("dead"):
                    sq[layer] = sq.get(layer, 0.0) + float(p.grad.norm()) ** 2
    return {k: v**0.5 for k, v in sq.items()}


def sharded_worker(rank: int, port: int, out: str, config: dict[str, Any]) -> None:
    """One rank of every sharded scenario (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    try:
        for name in SCENARIOS:
            engine, mode = name.rsplit("_", 1)
            _run(
                Path(out),
                name,
                rank,
                lambda e=engine, m=mode: _build(e, m == "ghost"),  # type: ignore[misc]
                config,
                lambda model, opt, e=engine: _loop(model, opt, rank, e, Path(out)),  # type: ignore[misc]
            )
    finally:
        dist.destroy_process_group()


def late_worker(rank: int, port: int, out: str) -> None:
    """One process: ``fully_shard`` called after ``watch()`` (and after the optimizer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradwatch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(model, opt, config={"console": False}) as watcher:
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
        Path(out, "late.json").write_text(watcher.report().model_dump_json())
    finally:
        dist.destroy_process_group()


FROZEN_ENGINES = ("fsdp2", "fsdp1_orig", "fsdp1_flat")


def frozen_worker(rank: int, port: int, out: str) -> None:
    """``encoder`` frozen mid-run while AdamW still holds it (grads zeroed, not ``None``).

    Writes ``frozen_<engine>.rank<r>.json`` (the report) and ``frozen_<engine>.moved.json``
    (which frozen layers' values changed on any rank, read without gradwatch: the truth).
    FSDP1 flattened (nested units, tests/_helpers/_flat_helpers.py) freezes the encoder's unit
    whole: one flat parameter, named ``encoder`` in the truth.
    """
    from _flat_helpers import _build as build_flat

    join_gloo(rank, port)

    def body(model: nn.Module, opt: torch.optim.Optimizer, engine: str) -> None:
        frozen: dict[str, torch.Tensor] = {}
        before: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            if step == 2:
                frozen = {n: p for n, p in model.named_parameters() if "encoder" in n}
                for n, p in frozen.items():
                    p.requires_grad_(False)
                    before[n] = _local_copy(p)
            opt.zero_grad(set_to_none=False)
            x, y = _data(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        moved = {}
        for n, p in frozen.items():
            flag = torch.tensor(float(not torch.equal(_local_copy(p), before[n])))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            moved[n.replace("_fsdp_wrapped_module.", "").rsplit(".", 1)[0]] = bool(flag)
        if rank == 0:
            Path(out, f"frozen_{engine}.moved.json").write_text(json.dumps(moved))

    try:
        for engine in FROZEN_ENGINES:
            _run(
                Path(out),
                f"frozen_{engine}",
                rank,
                lambda e=engine: (
                    build_flat("flat_clean") if e == "fsdp1_flat" else _build(e, False)
                ),  # type: ignore[misc]
                {},
                lambda model, opt, e=engine: body(model, opt, e),  # type: ignore[misc]
            )
    finally:
        dist.destroy_process_group()


def _local_copy(p: torch.Tensor) -> torch.Tensor:
    inner = getattr(p, "_local_tensor", p)
    return inner.detach().clone()
