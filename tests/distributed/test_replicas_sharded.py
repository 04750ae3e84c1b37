"""replica_divergence on the replicate dimension of HSDP (FSDP2 on a (replicate, shard) mesh),
2 CPU processes on gloo: replicas of one shard are compared with each other, never with ranks
holding other shards; plain FSDP2 has no replicas and stays silent; FSDP1 with replicas is
said to be unobserved (info), never a false pass."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _dist_helpers import WORLD, spawn_gloo
from _hsdp_helpers import (
    BY4,
    EDIT_AT,
    EDITED,
    EDITED4,
    SCENARIOS,
    SCENARIOS4,
    STEPS,
    WORLD4,
    hsdp4_worker,
    hsdp_worker,
)

from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.replica_divergence import ReplicaDivergence

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("hsdp")
    spawn_gloo(hsdp_worker, str(out), nprocs=WORLD)
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in SCENARIOS
    }


def _report(rec: dict[str, Any]) -> dict[str, Any]:
    assert rec["error"] is None, rec.get("traceback")
    report: dict[str, Any] = rec["report"]
    assert report["steps"] == STEPS
    return report


def _of(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check]


def test_hsdp_replica_edited_on_one_rank_is_named(runs: Runs) -> None:
    for rec in runs["hsdp_rank_edit"]:  # every rank says the same
        report = _report(rec)
        (f,) = _of(report, ReplicaDivergence.id)
        assert f["severity"] == "error" and report["failed"] is True
        assert f["params"] == [EDITED]
        assert f["details"]["ranks"] == [0, 1]
        assert f["details"]["first_step"] == EDIT_AT == f["first_step"]
        assert "optimizer_steps" not in f["details"]  # the optimizers agree: not their state


@pytest.mark.parametrize("scenario", ["hsdp_clean", "fsdp2_shard_only"])
def test_clean_sharded_runs_are_silent(runs: Runs, scenario: str) -> None:
    for rec in runs[scenario]:
        report = _report(rec)
        assert not _of(report, ReplicaDivergence.id)
        assert not _of(report, NotObserved.id), report["findings"]
        assert report["failed"] is False


def test_fsdp1_replicas_are_said_unobserved_not_passed(runs: Runs) -> None:
    for rec in runs["fsdp1_hybrid"]:
        report = _report(rec)
        assert not _of(report, ReplicaDivergence.id)
        (info,) = _of(report, NotObserved.id)
        assert info["severity"] == "info" and report["failed"] is False
        assert info["details"]["replicas"] is False
        assert "not compared by replica_divergence" in info["message"]


@pytest.fixture(scope="module")
def runs4(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("hsdp4")
    spawn_gloo(hsdp4_worker, str(out), nprocs=WORLD4)
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD4)]
        for name in SCENARIOS4
    }


def test_hsdp_2x2_compares_replicas_of_a_shard_never_the_shards(runs4: Runs) -> None:
    """Rank 3 edits its half of a weight: ranks 1 and 3 (the replicas of that half) are
    named; ranks 0 and 2 (the other half) are not, and the clean run's halves, which differ
    by design, raise nothing."""
    for rec in runs4["hsdp4_rank_edit"]:
        (f,) = _of(_report(rec), ReplicaDivergence.id)
        assert f["params"] == [EDITED4]
        assert f["details"]["ranks"] == sorted({BY4, BY4 - 2})  # [1, 3]: never 0 or 2
        assert f["details"]["first_step"] == EDIT_AT
    for rec in runs4["hsdp4_clean"]:
        assert not _of(_report(rec), ReplicaDivergence.id)
