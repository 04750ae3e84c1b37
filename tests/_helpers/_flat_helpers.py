"""Multi-process helpers for tests/distributed/test_fsdp1_flat.py: FSDP1 with flattened parameters.

:func:`flat_worker` runs under ``torch.multiprocessing.spawn`` on 2 CPU ranks (gloo) and
goes through :data:`SCENARIOS`, each rank writing ``<scenario>.rank<r>.json`` through the
DDP helpers' runner. Each rank then trains an *unsharded replica* of the same model on
both ranks' batches (FSDP averages the ranks' gradients) without gradwatch, and writes
``<scenario>.truth<r>.json``: every layer's gradient norm at the last step, its parameter
norm after it and the norm of its last update, and which parameters had a non-finite
gradient: the ground truth the report's shard-combined values must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from _dist_helpers import STEPS, WORLD, _data, _run, join_gloo
from torch import nn

SCENARIOS = ("flat_ghost", "flat_clean", "flat_nan", "flat_explode", "flat_unreadable", "flat_tied")
EXPLODE_MAX_NORM = 50.0
_CONFIG: dict[str, dict[str, Any]] = {
    "flat_explode": {"checks": {"exploding_grad": {"max_norm": EXPLODE_MAX_NORM}}},
}
# scenario -> (layer whose weight gradient is scaled at the last step, factor)
_TAMPER: dict[str, tuple[str, float]] = {
    "flat_nan": ("head", float("nan")),
    "flat_explode": ("encoder.2", 1e5),
}


_TAPS: dict[str, dict[str, Tap]] = {}


class _Scaled(torch.autograd.Function):
    """Identity forward; the backward scales the gradient (one tensor's gradient alone)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Tap(nn.Linear):
    """A Linear whose weight gradient is multiplied by ``factor`` (NaN, huge) when set."""

    factor: Optional[float] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.factor is None else _Scaled.apply(self.weight, self.factor)
        return nn.functional.linear(x, w, self.bias)


class Model(nn.Module):
    """``encoder`` and ``head`` train; ``dead`` (when present) never runs on any rank;
    ``tied`` adds two layers sharing one weight (FSDP1 lists the second in
    ``_shared_param_infos``)."""

    def __init__(self, dead: bool, tied: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), Tap(16, 8))
        self.head = Tap(8, 1)
        self.dead = nn.Linear(8, 8) if dead else None
        self.mix = nn.Linear(8, 8) if tied else None
        self.mix2 = nn.Linear(8, 8) if tied else None
        if self.mix is not None and self.mix2 is not None:
            self.mix2.weight = self.mix.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        if self.mix is not None and self.mix2 is not None:
            h = torch.tanh(self.mix2(torch.tanh(self.mix(h))))
        return self.head(h)


def _model(scenario: str) -> Model:
    torch.manual_seed(0)  # same initial weights on every rank and in the replica
    return Model(dead=scenario == "flat_ghost", tied=scenario == "flat_tied")


def _build(scenario: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _model(scenario)
    _TAPS[scenario] = _taps(model)
    cpu = torch.device("cpu")
    model.encoder = FSDP(model.encoder, device_id=cpu)  # two flat parameters: nested units
    sharded = FSDP(model, device_id=cpu)
    if scenario == "flat_unreadable":  # metadata that does not add up: never guessed at
        for mod in sharded.modules():
            fp = getattr(mod, "_flat_param", None)
            if fp is not None and "head.weight" in fp._fqns:  # the root unit's only
                fp._shard_param_infos = fp._shard_param_infos[:-1]
    return model, sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2)


def _taps(model: Model) -> dict[str, Tap]:
    """The tamperable layers by the user's names (taken before FSDP1 wraps the model)."""
    return {"head": model.head, "encoder.2": model.encoder[2]}  # type: ignore[dict-item]


def _tamper(taps: dict[str, Tap], scenario: str, step: int) -> None:
    if scenario in _TAMPER and step == STEPS - 1:
        layer, factor = _TAMPER[scenario]
        taps[layer].factor = factor


def _loop(model: nn.Module, opt: torch.optim.Optimizer, rank: int, scenario: str) -> None:
    taps = _TAPS.pop(scenario)
    for step in range(STEPS):
        _tamper(taps, scenario, step)
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = _data(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _truth(scenario: str) -> dict[str, Any]:
    """The replica's last step, per layer (no FSDP, no gradwatch): the test's ground truth."""
    model = _model(scenario)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        _tamper(_taps(model), scenario, step)
        opt.zero_grad()
        loss = sum(
            nn.functional.mse_loss(model(x), y) for x, y in (_data(r, step) for r in range(WORLD))
        )
        (loss / WORLD).backward()  # type: ignore[union-attr]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    sq: dict[str, dict[str, float]] = {}
    nonfinite = []
    for name, p in model.named_parameters():
        layer = name.rsplit(".", 1)[0]
        acc = sq.setdefault(layer, {"grad": 0.0, "param": 0.0, "delta": 0.0})
        if p.grad is None:
            continue
        if not bool(torch.isfinite(p.grad).all()):
            nonfinite.append(name)
        acc["grad"] += float(p.grad.double().norm()) ** 2
        acc["param"] += float(p.detach().double().norm()) ** 2
        acc["delta"] += float((p.detach() - before[name]).double().norm()) ** 2
    layers = {k: {m: v**0.5 for m, v in acc.items()} for k, acc in sq.items()}
    return {"layers": layers, "nonfinite": nonfinite}


def flat_worker(rank: int, port: int, out: str) -> None:
    """One rank of every flattened-FSDP1 scenario (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    try:
        for name in SCENARIOS:
            _run(
                Path(out),
                name,
                rank,
                lambda s=name: _build(s),  # type: ignore[misc]
                _CONFIG.get(name, {}),
                lambda model, opt, s=name: _loop(model, opt, rank, s),  # type: ignore[misc]
            )
            Path(out, f"{name}.truth{rank}.json").write_text(json.dumps(_truth(name)))
    finally:
        dist.destroy_process_group()
