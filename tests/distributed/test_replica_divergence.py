"""replica_divergence under DDP: 2 CPU processes on gloo. Replicas that drift apart are named
with their parameters, ranks and first step; DDP variants that keep them identical are silent."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _dist_helpers import WORLD, spawn_gloo
from _replica_helpers import SCENARIOS, replica_worker

from gradwatch.checks.replica_divergence import ReplicaDivergence

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("replicas")
    spawn_gloo(replica_worker, str(out), nprocs=WORLD)
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in SCENARIOS
    }


def _found(rec: dict[str, Any]) -> list[dict[str, Any]]:
    assert rec["error"] is None, rec.get("traceback")
    return [f for f in rec["report"]["findings"] if f["check"] == ReplicaDivergence.id]


@pytest.mark.parametrize(
    ("scenario", "params", "first"),
    [
        ("rank_conditional", {"b.weight"}, 1),
        ("rank_rng", {"a.weight"}, 2),
        ("no_sync_never_synced", {"a.weight", "a.bias", "b.weight", "b.bias"}, 1),
        ("optimizer_half_loaded", {"a.weight", "a.bias", "b.weight", "b.bias"}, 1),
    ],
)
def test_diverged_replicas_are_named(
    runs: Runs, scenario: str, params: set[str], first: int
) -> None:
    for rec in runs[scenario]:  # every rank says the same
        (f,) = _found(rec)
        assert f["severity"] == "error"
        assert set(f["params"]) == params
        assert f["details"]["ranks"] == [0, 1]
        assert f["details"]["first_step"] == first == f["first_step"]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.startswith("clean_")])
def test_identical_replicas_are_silent(runs: Runs, scenario: str) -> None:
    for rec in runs[scenario]:
        assert not _found(rec), rec["report"]["findings"]


def test_optimizer_state_loaded_on_one_rank_is_named_as_the_cause(runs: Runs) -> None:
    """Rank 0 resumed Adam at step 2, rank 1 from scratch: the step counts say why."""
    for rec in runs["optimizer_half_loaded"]:
        (f,) = _found(rec)
        steps = f["details"]["optimizer_steps"]  # at the last step the finding saw
        assert steps[0] - steps[1] == 2 and steps[1] > 0  # the two steps only rank 0 loaded
        assert "optimizer.state_dict() on every rank" in f["hint"]
    for name in ("rank_conditional", "rank_rng"):  # same optimizer state: not blamed
        for rec in runs[name]:
            assert "optimizer_steps" not in _found(rec)[0]["details"]
