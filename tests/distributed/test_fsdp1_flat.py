"""gradwatch under FSDP1 with flattened parameters (``use_orig_params=False``, the default).

2 CPU processes on gloo. Each original parameter is read from its slice of the rank's flat
shard; every value the report gives is checked against an unsharded replica trained on the
same batches without gradwatch (tests/_helpers/_flat_helpers.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from _dist_helpers import STEPS, WORLD, spawn_gloo
from _flat_helpers import EXPLODE_MAX_NORM, SCENARIOS, flat_worker

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]  # scenario -> one record per rank (+ ".truth")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("flat")
    spawn_gloo(flat_worker, str(out), nprocs=WORLD)
    found: Runs = {}
    for name in SCENARIOS:
        found[name] = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        found[f"{name}.truth"] = [
            json.loads((out / f"{name}.truth{r}.json").read_text()) for r in range(WORLD)
        ]
    return found


def _failing(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "error")]


def _layers(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {layer["name"]: layer for layer in report["layers"]}


def test_ghost_named_by_the_users_names_with_cause_and_ranks(runs: Runs) -> None:
    for rec in runs["flat_ghost"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        assert report["failed"] is True
        (ghost,) = _failing(report)
        assert ghost["check"] == "ghost_param"
        assert ghost["module"] == "dead"
        assert sorted(ghost["params"]) == ["dead.bias", "dead.weight"]
        assert ghost["details"]["cause"] == "not_called"
        assert ghost["details"]["ranks"] == [0, 1]
        layers = _layers(report)
        assert set(layers) == {"encoder.0", "encoder.2", "head", "dead"}
        assert layers["dead"]["numel"] == 8 * 8 + 8 and layers["dead"]["steps_with_grad"] == 0
        assert sorted(layers["head"]["params"]) == ["head.bias", "head.weight"]
    assert runs["flat_ghost"][1]["warnings"] == []  # rank 0 reports


def test_clean_twin_passes_with_the_replicas_statistics(runs: Runs) -> None:
    """Per-layer norms from the flat slices, combined across ranks, equal the replica's."""
    truth = runs["flat_clean.truth"][0]["layers"]
    for rec in runs["flat_clean"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        assert report["failed"] is False and _failing(report) == []
        assert rec["warnings"] == []
        (note,) = [f for f in report["findings"] if f["check"] == "not_observed"]
        assert note["severity"] == "info" and note["details"]["reason"] == "fsdp1_replicas"
        layers = _layers(report)
        assert set(layers) == set(truth) == {"encoder.0", "encoder.2", "head"}
        for name, want in truth.items():
            got = layers[name]
            assert got["grad_norm_last"] == pytest.approx(want["grad"], rel=1e-4), name
            assert got["param_norm"] == pytest.approx(want["param"], rel=1e-4), name
            assert got["steps_with_grad"] == STEPS
        assert layers["encoder.0"]["numel"] == 6 * 16 + 16  # the whole layer's, not a shard's
        # head (9 values, split over both ranks' shards) is fingerprinted in full on each
        # rank: its update is exact; a larger layer's is a sampled estimate (measure/fingerprint.py)
        head = truth["head"]
        assert layers["head"]["update_ratio"] == pytest.approx(
            head["delta"] / head["param"], rel=1e-4
        )
        for name, want in truth.items():
            ratio = want["delta"] / want["param"]
            assert layers[name]["update_ratio"] == pytest.approx(ratio, rel=0.3), name


def test_nonfinite_gradient_lands_on_the_users_layer(runs: Runs) -> None:
    truth = runs["flat_nan.truth"][0]
    assert truth["nonfinite"] == ["head.weight"]  # the replica's: only that tensor
    for rec in runs["flat_nan"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        (finding,) = [f for f in report["findings"] if f["check"] == "nonfinite_grad"]
        assert finding["params"] == truth["nonfinite"]
        assert finding["details"]["origin"] == "head.weight"
        assert finding["details"]["origin_layer"] == "head"
        assert finding["first_step"] == STEPS - 1
        assert math.isnan(_layers(report)["head"]["grad_norm_last"])


def test_exploding_gradient_lands_on_the_users_layer(runs: Runs) -> None:
    truth = runs["flat_explode.truth"][0]["layers"]
    huge = [name for name, want in truth.items() if want["grad"] > EXPLODE_MAX_NORM]
    assert huge == ["encoder.2"]
    for rec in runs["flat_explode"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        found = [f for f in report["findings"] if f["check"] == "exploding_grad"]
        assert [f["module"] for f in found] == huge
        assert found[0]["details"]["norm"] == pytest.approx(truth["encoder.2"]["grad"], rel=1e-4)
        assert sorted(found[0]["params"]) == ["encoder.2.bias", "encoder.2.weight"]


def test_unreadable_flat_layout_fails_the_report_never_guessed(runs: Runs) -> None:
    for rec in runs["flat_unreadable"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["steps"] == STEPS
        assert report["failed"] is True
        (finding,) = _failing(report)
        assert finding["check"] == "not_observed"
        assert finding["details"]["reason"] == "fsdp1_flat_params"
        assert finding["params"] == ["_flat_param"]
        problems = finding["details"]["problems"]
        assert problems == ["the flat parameter's metadata lists differ in length"]
        assert "use_orig_params=True" in finding["hint"]
        # the unit whose layout reads still gets per-layer statistics; the other one is
        # judged as one tensor under its own name
        layers = _layers(report)
        assert set(layers) == {"encoder.0", "encoder.2", "(root)"}
        assert layers["(root)"]["params"] == ["_flat_param"]


def test_tied_weight_is_one_slice_with_both_names(runs: Runs) -> None:
    """``mix2.weight`` is ``mix.weight``: FSDP1 keeps one slice (``_shared_param_infos``)."""
    truth = runs["flat_tied.truth"][0]["layers"]
    for rec in runs["flat_tied"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["failed"] is False and _failing(report) == []
        layers = _layers(report)
        assert set(layers) == set(truth) == {"encoder.0", "encoder.2", "mix", "mix2", "head"}
        assert sorted(layers["mix"]["params"]) == ["mix.bias", "mix.weight", "mix2.weight"]
        assert sorted(layers["mix2"]["params"]) == ["mix.weight", "mix2.bias", "mix2.weight"]
        for name, want in truth.items():  # the tied weight counts in its first layer
            assert layers[name]["grad_norm_last"] == pytest.approx(want["grad"], rel=1e-4), name
