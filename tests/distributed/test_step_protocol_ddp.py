"""Issue 30's step-protocol checks under DDP (2 CPU processes on gloo): ``no_sync``
accumulation with a clip before the step and a per-step schedule stays clean; ``zero_grad()``
inside that accumulation loop, a clip after the step and a scheduler stepped per micro-batch
are each found on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from _dist_helpers import WORLD, Plain, _data, _run, join_gloo, spawn_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradwatch.checks.clip_after_step import ClipAfterStep
from gradwatch.checks.scheduler_misstepped import SchedulerMisstepped
from gradwatch.checks.step_without_grad import StepWithoutGrad

pytestmark = pytest.mark.slow

STEPS, ACC = 4, 3


def _build() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Plain()
    ddp = DistributedDataParallel(model)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def _body(rank: int, bug: str) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    def body(ddp: nn.Module, opt: torch.optim.Optimizer) -> None:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
        for step in range(STEPS):
            for micro in range(ACC):
                if bug == "zero_inside":
                    opt.zero_grad()
                x, y = _data(rank, 10 * step + micro)
                last = micro == ACC - 1
                ctx = ddp.no_sync() if not last else _Null()  # type: ignore[operator]
                with ctx:
                    nn.functional.mse_loss(ddp(x), y).backward()
                if bug == "sched_micro":
                    sched.step()
            if bug != "clip_after":
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            if bug == "clip_after":
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if bug != "sched_micro":
                sched.step()
            opt.zero_grad()

    return body


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


BUGS = {
    "clean": None,
    "zero_inside": StepWithoutGrad.id,
    "clip_after": ClipAfterStep.id,
    "sched_micro": SchedulerMisstepped.id,
}


def _worker(rank: int, port: int, out: str) -> None:
    join_gloo(rank, port)
    try:
        for name in BUGS:
            _run(Path(out), name, rank, _build, {}, _body(rank, name))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("protocol")
    spawn_gloo(_worker, str(out), nprocs=WORLD)
    return {
        n: [json.loads((out / f"{n}.rank{r}.json").read_text()) for r in range(WORLD)] for n in BUGS
    }


@pytest.mark.parametrize("name", list(BUGS))
def test_each_rank_sees_the_same(runs: dict[str, list[dict[str, Any]]], name: str) -> None:
    for rec in runs[name]:
        assert rec["error"] is None, rec.get("traceback")
        found = {
            f["check"] for f in rec["report"]["findings"] if f["severity"] in ("warning", "error")
        }
        want = BUGS[name]
        assert found == (set() if want is None else {want}), rec["report"]["findings"]
