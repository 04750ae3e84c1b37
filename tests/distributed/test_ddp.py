"""gradwatch under DDP: 2 CPU processes on gloo, a raw loop and a Lightning ``strategy="ddp"``.

Each scenario runs in real processes on 127.0.0.1; every rank writes what it saw (report,
warnings, stdout, the error that ended it) to a tmp dir that the tests read back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dist_helpers import (
    RAW_SCENARIOS,
    WORLD,
    raw_worker,
    run_lightning_scenarios,
    spawn_gloo,
)

from gradwatch.checks.replica_divergence import ReplicaDivergence

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).parents[1] / "_helpers"
Raw = dict[str, list[dict[str, Any]]]  # scenario -> one record per rank


def _ghosts(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """ghost_param findings by layer."""
    return {f["module"]: f for f in report["findings"] if f["check"] == "ghost_param"}


# -- raw DistributedDataParallel loop ----------------------------------------------------


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """All raw-loop scenarios in one ``mp.spawn`` (process start-up dominates the cost)."""
    out = tmp_path_factory.mktemp("ddp_raw")
    spawn_gloo(raw_worker, str(out), nprocs=WORLD)
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in RAW_SCENARIOS
    }


def test_ghost_unused_on_one_rank_names_that_rank(raw: Raw) -> None:
    """find_unused_parameters=True: DDP names nothing; gradwatch names the layer and the rank."""
    for rec in raw["unused_true"]:
        assert rec["error"] is None
        ghosts = _ghosts(rec["report"])
        assert set(ghosts) == {"branch", "dead"}
        branch, dead = ghosts["branch"], ghosts["dead"]
        assert branch["params"] == ["branch.weight", "branch.bias"]
        assert branch["details"]["ranks"] == [1]  # ran on rank 0 only
        assert branch["details"]["world_size"] == WORLD
        assert "on rank(s) [1]" in branch["message"]
        # the cause comes from the rank that missed it, the counts are global
        assert branch["details"]["cause"] == "not_called"
        assert (branch["details"]["steps_missing"], branch["details"]["steps_seen"]) == (4, 0)
        assert dead["details"]["ranks"] == [0, 1]
        assert dead["details"]["cause"] == "not_called"
        assert [f for f in rec["report"]["findings"] if f["check"] != "ghost_param"] == []
    # identical findings on both ranks, reported (warned, printed) by rank 0 only
    rank0, rank1 = raw["unused_true"]
    assert _ghosts(rank0["report"]) == _ghosts(rank1["report"])
    assert sorted(w.split("]")[0] for w in rank0["warnings"]) == [  # one per finding
        "gradwatch ghost_param [branch (2 parameters)",
        "gradwatch ghost_param [dead (2 parameters)",
    ]
    assert rank1["warnings"] == []
    assert "gradwatch: FAILED" in rank0["stdout"] and "ghost_param" in rank0["stdout"]
    assert rank1["stdout"] == ""


def test_layer_statistics_are_global(raw: Raw) -> None:
    """.grad is DDP's average at the step: every rank reports the same norms, no extra collective."""
    for name in ("unused_true", "views_clean"):
        rank0, rank1 = (
            {layer["name"]: layer for layer in r["report"]["layers"]} for r in raw[name]
        )
        assert set(rank0) == set(rank1)
        keys = ("grad_norm_last", "grad_norm_mean", "steps_with_grad", "steps_without_grad")
        for layer, stats in rank0.items():
            for key in keys:
                mine, theirs = stats[key], rank1[layer][key]
                same = mine == theirs or mine == pytest.approx(theirs, rel=1e-6)
                assert same, (name, layer, key, mine, theirs)
    # the branch ran on rank 0 only, yet rank 1 reports its (averaged) gradient norm too
    branch = next(x for x in raw["unused_true"][1]["report"]["layers"] if x["name"] == "branch")
    assert branch["grad_norm_last"] is not None and branch["grad_norm_last"] > 0


def test_bucket_view_gradients_clean_loop_has_no_findings(raw: Raw) -> None:
    for rec in raw["views_clean"]:
        assert rec["error"] is None
        assert rec["report"]["findings"] == []
        assert rec["report"]["steps"] == 4


def test_bucket_view_gradients_missing_zero_grad_fires(raw: Raw) -> None:
    for rec in raw["views_missing_zero_grad"]:
        (finding,) = rec["report"]["findings"]
        assert finding["check"] == "missing_zero_grad"
        assert finding["params"] == ["a.weight", "a.bias", "b.weight", "b.bias"]
        assert finding["first_step"] == 1  # from the first step that consumed stale gradients
    assert len(raw["views_missing_zero_grad"][0]["warnings"]) == 1  # one per finding
    assert raw["views_missing_zero_grad"][1]["warnings"] == []


def test_step_without_backward_is_no_ghost_on_any_rank(raw: Raw) -> None:
    """A second step() with no backward since is no ghost: it applies one gradient twice."""
    for rec in raw["double_step"]:
        assert rec["error"] is None
        assert [f["check"] for f in rec["report"]["findings"]] == ["double_update"]
        (f,) = rec["report"]["findings"]
        assert f["details"]["optimizers"] == [{"index": 0, "class": "SGD"}]
        assert rec["report"]["steps"] == 8


def test_fail_fast_raises_at_the_first_step_on_every_rank(raw: Raw) -> None:
    for rec in raw["fail_fast"]:
        assert rec["error_type"] == "GhostLayerError"
        assert "branch.weight" in rec["error"] and "dead.weight" in rec["error"]
        assert rec["report"]["steps"] == 1


def test_report_is_ready_before_ddp_dies(raw: Raw) -> None:
    """find_unused_parameters=False: DDP's error only comes at the next forward."""
    for rec in raw["unused_false_dies"]:
        assert rec["error_type"] == "RuntimeError"
        assert "Expected to have finished reduction" in rec["error"]
        assert rec["report"]["steps"] == 1
        ghosts = _ghosts(rec["report"])
        assert ghosts["branch"]["details"]["ranks"] == [1]
        assert ghosts["dead"]["details"]["ranks"] == [0, 1]


# -- Lightning, strategy="ddp" ----------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both Lightning scenarios, launched side by side (each start-up imports Lightning twice)."""
    outs = {s: tmp_path_factory.mktemp(f"pl_{s}") for s in ("unused_true", "unused_false")}
    run_lightning_scenarios([str(HELPERS / "_dist_helpers.py"), "lightning"], outs)
    return outs


def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_lightning_ddp_names_ghosts_and_ranks(lightning_ddp: dict[str, Path]) -> None:
    out = lightning_ddp["unused_true"]
    rank0, rank1 = _ranks(out)
    for rec in (rank0, rank1):
        assert rec["error"] is None
        assert rec["report"]["steps"] == 3
        ghosts = _ghosts(rec["report"])
        assert ghosts["branch"]["details"]["ranks"] == [0]  # used on rank 1 only
        assert ghosts["branch"]["details"]["cause"] == "not_called"
        assert ghosts["dead"]["details"]["ranks"] == [0, 1]
    assert len(rank0["warnings"]) == 2 and rank1["warnings"] == []  # branch, dead
    # rank 0 writes the report and the metrics into the logger's log dir
    log_dir = out / "csv" / "version_0"
    written = json.loads((log_dir / "gradwatch-report.json").read_text())
    assert _ghosts(written) == _ghosts(rank0["report"])
    header = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    expected = {"gradwatch/grad_norm/branch", "gradwatch/grad_norm_total", "gradwatch/findings"}
    assert expected <= set(header)


def test_lightning_ddp_report_written_before_ddp_crash(lightning_ddp: dict[str, Path]) -> None:
    """strategy="ddp" (find_unused_parameters=False) dies at step 2; the report names why."""
    out = lightning_ddp["unused_false"]
    for rec in _ranks(out):
        assert rec["error"] is not None and "were not used in producing the loss" in rec["error"]
        assert rec["report"]["steps"] == 1
        assert set(_ghosts(rec["report"])) == {"branch", "dead"}
    written = json.loads((out / "csv" / "version_0" / "gradwatch-report.json").read_text())
    assert written["failed"] and set(_ghosts(written)) == {"branch", "dead"}


def test_no_replica_divergence_in_any_ddp_variant(raw: Raw, lightning_ddp: dict[str, Path]) -> None:
    """DDP keeps its replicas bit-identical in every variant above (replica_divergence)."""
    records = [rec for recs in raw.values() for rec in recs]
    records += [rec for out in lightning_ddp.values() for rec in _ranks(out)]
    for rec in records:
        checks = {f["check"] for f in rec["report"]["findings"]}
        assert ReplicaDivergence.id not in checks, rec["report"]["findings"]
