"""resume_mismatch across world sizes: checkpoints saved by 2 gloo ranks (DDP with torch.save,
FSDP2 with torch.distributed.checkpoint) resumed in one process. A faithful resume is silent
(resharded: an info says the shards' checksums are not compared); a fresh optimizer is still
caught (with the learning rate it starts from), and under DDP the weights of another
checkpoint too (whole parameters compare at any world size)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_helpers import WORLD, spawn_gloo
from _resharded_helpers import CFG, STEPS, parts, save_worker, train

import gradwatch
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.resume_mismatch import ResumeMismatch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resharded")
    spawn_gloo(save_worker, str(out), nprocs=WORLD)
    return out


def _resumed(load: Any, gradwatch_state: dict[str, Any]) -> gradwatch.Report:
    """Build the parts, ``load(model, opt, sched)`` them, resume for one step, the report."""
    model, opt, sched = parts()
    load(model, opt, sched)
    with gradwatch.watch(model, opt, config=CFG) as w:
        w.load_state_dict(gradwatch_state, step=STEPS)
        train(model, opt, sched, 0, 1, at=STEPS)
    return w.report()


def _aspects(report: gradwatch.Report) -> list[str]:
    return sorted(f.details["aspect"] for f in report.by_check(ResumeMismatch.id))


@pytest.mark.parametrize(
    ("wrong", "aspects"), [(None, []), ("opt", ["lr", "optimizer"]), ("model", ["params"])]
)
def test_ddp_saved_at_2_ranks_resumed_at_1(saved: Path, wrong: str, aspects: list[str]) -> None:
    ck = torch.load(saved / "ddp.pt", weights_only=True)

    def load(model: Any, opt: Any, sched: Any) -> None:
        if wrong != "model":
            model.load_state_dict(ck["model"])
        if wrong != "opt":
            opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])

    report = _resumed(load, ck["gradwatch"])
    assert _aspects(report) == aspects, [f.message for f in report.findings]
    assert not report.by_check(NotObserved.id)  # whole parameters: nothing left unchecked
    assert report.failed is bool(aspects)


@pytest.mark.parametrize("fresh_optimizer", [False, True])
def test_fsdp2_dcp_saved_at_2_ranks_resumed_at_1(saved: Path, fresh_optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    ck = torch.load(saved / "fsdp2.pt", weights_only=True)

    def load(model: Any, opt: Any, sched: Any) -> None:
        with warnings.catch_warnings():  # DCP in one process says it assumes so
            warnings.simplefilter("ignore")
            if fresh_optimizer:
                msd = sd.get_model_state_dict(model)
                dcp.load({"model": msd}, checkpoint_id=str(saved / "dcp"))
                sd.set_model_state_dict(model, msd)
            else:
                msd, osd = sd.get_state_dict(model, opt)
                both = {"model": msd, "optim": osd}
                dcp.load(both, checkpoint_id=str(saved / "dcp"))
                sd.set_state_dict(
                    model, opt, model_state_dict=both["model"], optim_state_dict=both["optim"]
                )
        sched.load_state_dict(ck["sched"])

    report = _resumed(load, ck["gradwatch"])
    assert _aspects(report) == (["lr", "optimizer"] if fresh_optimizer else [])
    (info,) = report.by_check(NotObserved.id)  # the shards' checksums: said, not passed
    assert info.severity == "info" and info.details["reason"] == "resume_resharded"
    assert report.failed is fresh_optimizer
