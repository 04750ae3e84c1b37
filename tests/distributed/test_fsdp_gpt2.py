"""A real architecture under sharding: GPT-2 built from a config, FSDP2 and FSDP1 (both layouts).

The sharded tests in tests/distributed/test_fsdp*.py use small hand-built models, where every
parameter's path through the engine is known. This one runs what users run: a transformers
GPT-2 (tied embedding and head, each block its own FSDP unit), AdamW, 2 CPU ranks on gloo.
Ground truth: the same run without gradwatch (its losses), and an extra ``nn.Linear`` that
is never called (the ghost must be named, with its cause and both ranks).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _dist_helpers import WORLD, spawn_gloo
from _gpt2_sharded import SCENARIOS, STEPS, gpt2_worker

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]  # scenario -> one record per rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gpt2")
    spawn_gloo(gpt2_worker, str(out), nprocs=WORLD)
    found: Runs = {}
    for name in SCENARIOS:
        found[name] = []
        for r in range(WORLD):
            record = json.loads((out / f"{name}.rank{r}.json").read_text())
            record["losses"] = json.loads((out / f"{name}.losses{r}.json").read_text())
            found[name].append(record)
    return found


def _failing(report: dict[str, Any]) -> list[str]:
    return [
        f"{f['check']} {f['params']} {f['details'].get('reason')}"
        for f in report["findings"]
        if f["severity"] in ("warning", "error")
    ]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.endswith("_clean")])
def test_clean_gpt2_passes_and_trains_exactly_as_without_gradwatch(
    runs: Runs, scenario: str
) -> None:
    for record in runs[scenario]:
        assert record["error"] is None, record.get("traceback")
        report = record["report"]
        assert report["steps"] == STEPS and report["backward_passes"] == STEPS
        assert not report["failed"] and not _failing(report), _failing(report)
        assert record["losses"]["watched"] == record["losses"]["bare"]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.endswith("_ghost")])
def test_ghost_head_is_named_with_cause_and_ranks(runs: Runs, scenario: str) -> None:
    for record in runs[scenario]:
        assert record["error"] is None, record.get("traceback")
        report = record["report"]
        assert report["failed"]
        ghosts = [f for f in report["findings"] if f["check"] == "ghost_param"]
        assert len(ghosts) == 1, _failing(report)
        assert sorted(ghosts[0]["params"]) == ["aux.bias", "aux.weight"]
        assert ghosts[0]["details"]["cause"] == "not_called"
        assert ghosts[0]["details"]["ranks"] == [0, 1]
        # nothing else is flagged: the tied wte/lm_head and every block trained
        assert len(_failing(report)) == 1, _failing(report)
        assert record["losses"]["watched"] == record["losses"]["bare"]
