"""Multi-process helpers for tests/distributed/test_fsdp1_disconnected.py: 2 CPU ranks on gloo.

FSDP1 (``use_orig_params=True`` and flattened) hands a parameter that got no gradient a zero
slice: a layer that ran but whose output never reached the loss must still be a ghost
(``disconnected``), and a dead layer (its output reached, its gradient zero) must not.
:func:`reach_worker` runs every model of :data:`MODELS` under both engines, each rank writing
``<model>_<engine>.rank<r>.json`` through the DDP helpers' runner.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from _dist_helpers import STEPS, _data, _run, join_gloo
from torch import nn

ENGINES = ("orig", "flat")


class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 1)


class UnusedAuxHead(_Trunk):
    """An auxiliary head computed in forward (kept for logging) and left out of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        self.aux_logits = self.aux(h)  # the bug: never in the loss
        return self.head(h)


class DetachedAdapter(_Trunk):
    """A residual adapter whose output is detached before it is added."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        h = h + self.adapter(h).detach()  # the bug
        return self.head(h)


class ArgmaxRouter(_Trunk):
    """Hard top-1 routing: the router's scores go through argmax, which has no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        pick = self.router(h).argmax(-1, keepdim=True)  # the bug: no gradient to the router
        both = torch.stack([e(h) for e in self.experts], dim=1)  # (N, 2, 8)
        chosen = torch.gather(both, 1, pick.unsqueeze(-1).expand(-1, 1, 8)).squeeze(1)
        return self.head(chosen + 0.1 * both.mean(1))


class DeadLayer(_Trunk):
    """Look-alike: a layer behind a ReLU that never fires: its output gets zeros (dead)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.bias.fill_(-10.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        return self.head(h + torch.relu(self.gate(h)))


class PairOutput(nn.Module):
    """Returns ``(features, summary)``; the caller uses only the summary."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.proj(h)
        return out.detach(), out.mean(-1, keepdim=True)


class SecondOutputUsed(_Trunk):
    """Look-alike: a layer whose first output is unused and second is (an LSTM's ``h_n``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = PairOutput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        _, summary = self.pair(h)
        return self.head(h) + summary


MODELS: dict[str, type[nn.Module]] = {
    "aux": UnusedAuxHead,
    "detached": DetachedAdapter,
    "router": ArgmaxRouter,
    "dead": DeadLayer,
    "pair": SecondOutputUsed,
}


def _build(kind: str, engine: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)  # same initial weights on every rank
    model = MODELS[kind]()
    sharded = FullyShardedDataParallel(
        model, use_orig_params=engine == "orig", device_id=torch.device("cpu")
    )
    return model, sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2)


def _loop(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS + 1):  # dead_param's patience (3) is reached
        opt.zero_grad()
        x, y = _data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def reach_worker(rank: int, port: int, out: str) -> None:
    """One rank of every model under both FSDP1 engines (``mp.spawn`` target)."""
    join_gloo(rank, port)
    try:
        for kind in MODELS:
            for engine in ENGINES:
                _run(
                    Path(out),
                    f"{kind}_{engine}",
                    rank,
                    lambda k=kind, e=engine: _build(k, e),  # type: ignore[misc]
                    {},
                    lambda model, opt: _loop(model, opt, rank),
                )
    finally:
        dist.destroy_process_group()
