"""Lightning with sharded training: FSDP2 through ``ModelParallelStrategy`` on 2 CPU ranks.

``strategy="fsdp"`` (Lightning's FSDP1 strategy) refuses a CPU accelerator, so it cannot be
run here; the refusal is pinned below (docs/distributed.md says so too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dist_helpers import run_lightning_scenarios

HELPERS = Path(__file__).parents[1] / "_helpers"
WORLD, STEPS = 2, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    outs = {s: tmp_path_factory.mktemp(f"pl_fsdp_{s}") for s in ("ghost", "clean")}
    run_lightning_scenarios([str(HELPERS / "_lightning_fsdp.py")], outs)
    return {
        s: [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
        for s, out in outs.items()
    }


def _failing(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "error")]


@pytest.mark.slow
def test_lightning_fsdp2_names_the_ghost_with_cause_and_ranks(runs: Any) -> None:
    for rec in runs["ghost"]:
        assert rec["error"] is None
        report = rec["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        (ghost,) = _failing(report)
        assert ghost["check"] == "ghost_param" and ghost["module"] == "dead"
        assert sorted(ghost["params"]) == ["dead.bias", "dead.weight"]
        assert ghost["details"]["cause"] == "not_called"
        assert ghost["details"]["ranks"] == [0, 1]
    assert runs["ghost"][1]["warnings"] == []  # rank 0 reports


@pytest.mark.slow
def test_lightning_fsdp2_clean_twin_passes(runs: Any) -> None:
    for rec in runs["clean"]:
        assert rec["error"] is None
        report = rec["report"]
        assert report["steps"] == STEPS and report["failed"] is False
        assert _failing(report) == [] and rec["warnings"] == []
        names = {layer["name"] for layer in report["layers"]}
        assert names == {"encoder.0", "encoder.2", "head"}


def test_lightning_fsdp1_strategy_refuses_cpu() -> None:
    """What docs/distributed.md reports: Lightning's FSDP1 strategy needs a GPU (checked, not assumed)."""
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)
