"""Multi-process helper for tests/distributed/test_fsdp_gpt2.py: a real GPT-2 (built from a config)
under FSDP2 and FSDP1, 2 CPU ranks on gloo.

:func:`gpt2_worker` runs under ``torch.multiprocessing.spawn`` and goes through
:data:`SCENARIOS`; per scenario each rank trains once without gradwatch (the losses are the
ground truth) and once under ``watch()``, writing ``<scenario>.rank<r>.json`` (report,
warnings, error) and ``<scenario>.losses<r>.json`` (``{"bare": [...], "watched": [...]}``).
"""

from __future__ import annotations

import json
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _architectures import ARCHITECTURES, V
from _dist_helpers import _run, join_gloo
from torch import nn

STEPS = 4
ENGINES = ("fsdp2", "fsdp1_orig", "fsdp1_flat")
SCENARIOS = tuple(f"{e}_{m}" for e in ENGINES for m in ("clean", "ghost"))


def _build(engine: str, ghost: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    model, _ = ARCHITECTURES["gpt2"]()  # the suite's tiny GPT-2 (tied wte and lm_head)
    if ghost:
        model.aux = nn.Linear(32, 32)  # a head added for an experiment and never called
    block = type(model.transformer.h[0])
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.transformer.h:
            fully_shard(b)
        fully_shard(model)
        sharded: nn.Module = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        sharded = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({block}),
            use_orig_params=engine == "fsdp1_orig",
            device_id=torch.device("cpu"),
        )
    return model, sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-3)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(rank)  # each rank its own batches
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(3, V, (2, 12), generator=g)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def gpt2_worker(rank: int, port: int, out: str) -> None:
    """One rank of every scenario (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    warnings.filterwarnings("ignore", module="transformers")  # config notices on tiny vocabs
    try:
        for name in SCENARIOS:
            engine, mode = name.rsplit("_", 1)
            _, bare, bare_opt = _build(engine, mode == "ghost")
            losses: dict[str, Any] = {"bare": _train(bare, bare_opt, rank)}

            def body(model: nn.Module, opt: torch.optim.Optimizer, into: Any = losses) -> None:
                into["watched"] = _train(model, opt, rank)

            _run(Path(out), name, rank, partial(_build, engine, mode == "ghost"), {}, body)
            (Path(out) / f"{name}.losses{rank}.json").write_text(json.dumps(losses))
    finally:
        dist.destroy_process_group()
