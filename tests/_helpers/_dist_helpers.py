"""Multi-process helpers for tests/distributed/test_ddp.py: 2 CPU ranks on gloo, real DDP.

Two entry points:

- :func:`raw_worker` runs under ``torch.multiprocessing.spawn``: a plain DDP loop through a
  list of scenarios, each rank writing ``<scenario>.rank<r>.json`` (its report, the
  gradwatch warnings it emitted, what it printed, the error that ended it).
- ``python tests/_helpers/_dist_helpers.py lightning OUT SCENARIO``: a Lightning ``Trainer`` with
  ``strategy="ddp"`` (its launcher re-runs this script for rank 1), each rank writing
  ``OUT/rank<r>.json`` after fit, even when fit raised.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradwatch

WORLD = 2
STEPS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SPAWN_TRIES = 5


def spawn_gloo(fn: Any, *args: Any, nprocs: int = WORLD) -> None:
    """``mp.spawn(fn, args=(port, *args))`` on a fresh port, again when a rank was killed by
    a signal. On this 2-core machine gloo now and then aborts a rank as it exits ("terminate
    called without an active exception", SIGABRT; seen on the code of earlier rounds too, one
    run in three of the distributed tests): that is the harness, not a result. A rank that
    raised, or an assertion on what the ranks wrote, is never retried."""
    import torch.multiprocessing as mp

    for attempt in range(SPAWN_TRIES):
        try:
            mp.spawn(fn, args=(free_port(), *args), nprocs=nprocs, join=True)
            return
        except mp.ProcessExitedException as exc:
            if exc.signal_name is None or attempt == SPAWN_TRIES - 1:
                raise
            time.sleep(1.0 + attempt)  # let the aborted ranks' sockets and shared memory go


class Net(nn.Module):
    """``branch`` runs only on rank 0; ``dead`` never runs (a permanent ghost)."""

    def __init__(self, rank: int, dead: bool = True) -> None:
        super().__init__()
        self.rank = rank
        self.stem = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.dead = nn.Linear(8, 8) if dead else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.rank == 0:
            h = h + self.branch(h)
        return self.head(h)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def join_gloo(rank: int, port: int, world_size: Optional[int] = None) -> None:
    """Join this spawned rank to a gloo group on ``port`` (one torch thread, 60 s timeout)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD if world_size is None else world_size,
        timeout=timedelta(seconds=60),
    )


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)


def _loop(
    ddp: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: int = STEPS,
    zero_grad: Optional[bool] = True,
    double_step: bool = False,
) -> None:
    for step in range(steps):
        if zero_grad is not None and (zero_grad or step == 0):
            opt.zero_grad(set_to_none=step % 2 == 0)  # both kinds of reset
        x, y = _data(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if double_step:
            opt.step()


def _run(
    out: Path,
    name: str,
    rank: int,
    build: Callable[[], tuple[nn.Module, nn.Module, torch.optim.Optimizer]],
    config: dict[str, Any],
    body: Callable[[nn.Module, torch.optim.Optimizer], None],
) -> None:
    """Run one scenario under ``watch()`` and write what this rank saw, whatever happens."""
    record: dict[str, Any] = {"rank": rank, "error": None, "error_type": None}
    watcher = None
    stdout = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(stdout):
        warnings.simplefilter("always")
        try:
            _model, ddp, opt = build()
            watcher = gradwatch.watch(ddp, opt, config={"every_n_steps": 1, **config})
            with watcher:
                body(ddp, opt)
        except Exception as exc:  # the test reads the error back: DDP's own crash included
            record["error"] = str(exc)
            record["error_type"] = type(exc).__name__
            record["traceback"] = traceback.format_exc()
        finally:
            if watcher is not None:
                record["report"] = watcher.report().model_dump(mode="json")
    record["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)
    ]
    record["stdout"] = stdout.getvalue()
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))


def _ddp(model: nn.Module, **kw: Any) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    ddp = DistributedDataParallel(model, **kw)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)


RAW_SCENARIOS = (
    "unused_true",
    "views_clean",
    "views_missing_zero_grad",
    "double_step",
    "fail_fast",
    "unused_false_dies",
)


def raw_worker(rank: int, port: int, out: str) -> None:
    """One rank of the raw DDP scenarios (``torch.multiprocessing.spawn`` target)."""
    join_gloo(rank, port)
    path = Path(out)
    try:
        torch.manual_seed(0)
        # 1. find_unused_parameters=True: DDP names nothing; gradwatch names both ghosts.
        _run(
            path,
            "unused_true",
            rank,
            lambda: _ddp(Net(rank), find_unused_parameters=True),
            {"console": True},
            lambda ddp, opt: _loop(ddp, opt, rank),
        )
        # 2./3. gradient_as_bucket_view=True: .grad are views of DDP's buckets.
        _run(
            path,
            "views_clean",
            rank,
            lambda: _ddp(Plain(), gradient_as_bucket_view=True),
            {},
            lambda ddp, opt: _loop(ddp, opt, rank),
        )
        _run(
            path,
            "views_missing_zero_grad",
            rank,
            lambda: _ddp(Plain(), gradient_as_bucket_view=True),
            {},
            lambda ddp, opt: _loop(ddp, opt, rank, zero_grad=False),
        )
        # 4. a second step() with no backward since: not a ghost on any rank.
        _run(
            path,
            "double_step",
            rank,
            lambda: _ddp(Plain()),
            {},
            lambda ddp, opt: _loop(ddp, opt, rank, double_step=True),
        )
        # 5. fail_fast: the first step raises on every rank, before DDP's own error.
        _run(
            path,
            "fail_fast",
            rank,
            lambda: _ddp(Net(rank)),
            {"fail_fast": True},
            lambda ddp, opt: _loop(ddp, opt, rank),
        )
        # 6. find_unused_parameters=False: DDP dies at the second forward; the report is ready.
        _run(
            path,
            "unused_false_dies",
            rank,
            lambda: _ddp(Net(rank)),
            {},
            lambda ddp, opt: _loop(ddp, opt, rank),
        )
    finally:
        dist.destroy_process_group()


# -- Lightning, strategy="ddp" ----------------------------------------------------------


def run_lightning_scenarios(script: list[str], outs: dict[str, Path]) -> None:
    """Run ``python *script OUT SCENARIO`` for each scenario side by side (each start-up
    imports Lightning twice) and wait: Lightning's launcher starts the other rank itself."""
    procs = {}
    for scenario, out in outs.items():
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
            env.pop(var, None)
        with open(out / "launcher.log", "wb") as log:  # the child keeps its own descriptor
            procs[scenario] = subprocess.Popen(
                [sys.executable, *script, str(out), scenario],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    for scenario, proc in procs.items():
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log_text = (outs[scenario] / "launcher.log").read_text(errors="replace")
        assert rc == 0, f"{scenario}: exit {rc}\n{log_text[-3000:]}"


def fit_and_record(trainer: Any, cb: Any, module: Any, data: Any, out: Path) -> None:
    """``trainer.fit``, then this rank's error, report and gradwatch warnings as
    ``rank<r>.json``; rank 0 waits for the ranks its launcher started."""
    record: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, data)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
    record["rank"] = trainer.global_rank
    record["report"] = cb.report.model_dump(mode="json") if cb.report is not None else None
    record["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, gradwatch.GradWatchWarning)
    ]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    launcher = trainer.strategy.launcher
    for proc in getattr(launcher, "procs", None) or []:  # rank 0 started rank 1: wait for it
        proc.wait(timeout=120)


def _lightning_main(out: Path, scenario: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import pytorch_lightning as pl
    from _lightning_helpers import DIM, loader
    from pytorch_lightning.loggers import CSVLogger

    from gradwatch.lightning import GradWatchCallback

    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    torch.set_num_threads(1)

    class RankBranch(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(DIM, 8)
            self.branch = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)
            self.dead = nn.Linear(8, 8)  # never used: a permanent ghost

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            h = torch.tanh(self.stem(x))
            if self.global_rank == 1:
                h = h + self.branch(h)  # used on rank 1 only
            return nn.functional.mse_loss(self.head(h), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    strategy = "ddp_find_unused_parameters_true" if scenario == "unused_true" else "ddp"
    cb = GradWatchCallback(config={"every_n_steps": 1})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=3,
        limit_train_batches=3,
        enable_checkpointing=False,
        logger=CSVLogger(out, name="csv", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        callbacks=[cb],
    )
    fit_and_record(trainer, cb, RankBranch(), loader(n=48, batch=4, seed=trainer.global_rank), out)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "lightning":
        raise SystemExit("usage: _dist_helpers.py lightning OUT_DIR SCENARIO")
    _lightning_main(Path(sys.argv[2]), sys.argv[3])
