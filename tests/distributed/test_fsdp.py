"""gradwatch under FSDP2 and FSDP1: 2 CPU processes on gloo, a ghost model and a clean twin each.

Every rank writes what it saw (report, warnings, the error that ended it) and, after the
run, each layer's gradient norm from the *full* gradients (``full_tensor`` /
``summon_full_params``) that the report's shard-combined norms must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dist_helpers import STEPS, WORLD, spawn_gloo
from _sharded_helpers import FROZEN_ENGINES, SCENARIOS, frozen_worker, late_worker, sharded_worker

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]  # scenario -> one record per rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every engine's scenarios in one ``mp.spawn`` (process start-up dominates the cost)."""
    out = tmp_path_factory.mktemp("sharded")
    spawn_gloo(sharded_worker, str(out), {}, nprocs=WORLD)
    found: Runs = {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in SCENARIOS
    }
    for engine in ("fsdp2", "fsdp1_orig", "fsdp1_inner"):
        found[f"{engine}_expected"] = [
            json.loads((out / f"{engine}.expected{r}.json").read_text()) for r in range(WORLD)
        ]
    return found


def _failing(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "error")]


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1_orig", "fsdp1_flat", "fsdp1_inner"])
def test_ghost_named_with_the_users_names_cause_and_ranks(runs: Runs, engine: str) -> None:
    for rec in runs[f"{engine}_ghost"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        assert report["failed"] is True
        (ghost,) = [f for f in _failing(report)]
        assert ghost["check"] == "ghost_param"
        assert ghost["module"] == "dead"
        assert sorted(ghost["params"]) == ["dead.bias", "dead.weight"]
        assert ghost["details"]["cause"] == "not_called"
        assert ghost["details"]["ranks"] == [0, 1]
        names = [layer["name"] for layer in report["layers"]]
        assert not any("_fsdp_wrapped_module" in n or "_flat_param" in n for n in names)
        assert {"encoder.0", "encoder.2", "head", "dead"} <= set(names)
    assert runs[f"{engine}_ghost"][1]["warnings"] == []  # rank 0 reports


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1_orig", "fsdp1_inner"])
def test_clean_twin_passes_with_global_statistics(runs: Runs, engine: str) -> None:
    """Shard norms combined across ranks equal the norms of the full gradients, on both ranks.

    FSDP1 flattened cannot summon full gradients: tests/distributed/test_fsdp1_flat.py checks it
    against an unsharded replica instead."""
    expected = runs[f"{engine}_expected"][0]
    assert expected == runs[f"{engine}_expected"][1]
    for rec in runs[f"{engine}_clean"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        assert report["failed"] is False and _failing(report) == []
        assert rec["warnings"] == []
        layers = {layer["name"]: layer for layer in report["layers"]}
        for key, value in expected.items():
            if key.startswith("update_ratio:"):
                continue
            assert layers[key]["grad_norm_last"] == pytest.approx(value, rel=1e-5), key
            assert layers[key]["steps_with_grad"] == STEPS
        # The update ratio from copy-free fingerprints of each rank's pieces, combined
        # across ranks: exact where a piece is sampled in full (head: 9 values, in pieces
        # of either rank; FSDP2 leaves rank 1 an empty shard of it), an estimate elsewhere.
        ratio = {k.split(":", 1)[1]: v for k, v in expected.items() if ":" in k}
        assert set(ratio) == {"encoder.0", "encoder.2", "head"}
        assert layers["head"]["update_ratio"] == pytest.approx(ratio["head"], rel=1e-4)
        for name, want in ratio.items():
            assert layers[name]["update_ratio"] == pytest.approx(want, rel=0.3), name
        # numel is the full layer's, not this rank's shard
        assert layers["encoder.0"]["numel"] == 6 * 16 + 16


@pytest.mark.parametrize("engine", ["fsdp1_orig", "fsdp1_flat", "fsdp1_inner"])
def test_fsdp1_says_its_replicas_are_out_of_reach(runs: Runs, engine: str) -> None:
    for rec in runs[f"{engine}_clean"]:
        blind = [f for f in rec["report"]["findings"] if f["check"] == "not_observed"]
        (note,) = [f for f in blind if f["details"]["reason"] == "fsdp1_replicas"]
        assert note["severity"] == "info"
        assert len(blind) == 1


def test_sharding_after_watch_fails_the_report_with_one_line(tmp_path: Path) -> None:
    """fully_shard after watch(): the hooks hold the old tensors; the report must not pass."""

    spawn_gloo(late_worker, str(tmp_path), nprocs=1)
    report = json.loads((tmp_path / "late.json").read_text())
    assert report["failed"] is True
    # sharding after watch() also replaces the watched parameters (params_replaced, issue 44)
    (finding,) = [
        f
        for f in report["findings"]
        if f["check"] == "not_observed" and f["details"]["reason"] == "sharded_after_watch"
    ]
    assert "Shard first" in finding["hint"]


def test_frozen_shards_moved_by_the_optimizer_are_named(tmp_path: Path) -> None:
    """frozen_param_updated on local pieces' fingerprints, ORed across ranks, vs the truth.

    FSDP2 keeps a frozen parameter's zeroed gradient and AdamW's weight decay moves it;
    FSDP1 (use_orig_params) gives it no gradient, so AdamW leaves it: no finding there.
    FSDP1 flattened freezes the encoder's unit whole; its original layers are named.
    """
    spawn_gloo(frozen_worker, str(tmp_path), nprocs=WORLD)
    for engine in FROZEN_ENGINES:
        moved = json.loads((tmp_path / f"frozen_{engine}.moved.json").read_text())
        if engine == "fsdp1_flat":  # one flat parameter: the unit's layers move together
            assert set(moved) == {"encoder"}
            moved = {"encoder.0": moved["encoder"], "encoder.2": moved["encoder"]}
        want = sorted({layer for layer, m in moved.items() if m})
        assert set(moved) == {"encoder.0", "encoder.2"}
        for r in range(WORLD):
            rec = json.loads((tmp_path / f"frozen_{engine}.rank{r}.json").read_text())
            assert rec["error"] is None, rec.get("traceback")
            found = rec["report"]["findings"]
            got = sorted(f["module"] for f in found if f["check"] == "frozen_param_updated")
            assert got == want, engine
    assert json.loads((tmp_path / "frozen_fsdp2.moved.json").read_text())["encoder.0"] is True
    assert json.loads((tmp_path / "frozen_fsdp1_flat.moved.json").read_text())["encoder"] is True
    rec = json.loads((tmp_path / "frozen_fsdp1_flat.rank0.json").read_text())
    for f in rec["report"]["findings"]:  # no wrapper's name, even in the layout findings
        assert not any("_flat_param" in p for p in f["params"]), f
