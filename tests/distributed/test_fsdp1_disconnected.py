"""FSDP1 disconnected ghosts (SPEC section 6): 2 CPU ranks on gloo, real FSDP1, both layouts.

A layer that ran but whose output never reached the loss gets a zero gradient slice from
FSDP1: it must be an error ``ghost_param`` with ``details.cause: disconnected`` on every
rank's report, with ``use_orig_params=True`` and with flat parameters. Three forms (an
unused auxiliary head, a detached adapter, a router behind ``argmax``) and two look-alikes
(a dead layer whose output gets zeros: ``dead_param``; a layer whose first output is unused
but whose second is: clean).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _dist_helpers import WORLD, spawn_gloo
from _fsdp1_reach_helpers import ENGINES, MODELS, reach_worker

pytestmark = pytest.mark.slow

Runs = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("fsdp1_reach")
    spawn_gloo(reach_worker, str(out), nprocs=WORLD)
    found: Runs = {}
    for kind in MODELS:
        for engine in ENGINES:
            name = f"{kind}_{engine}"
            found[name] = [
                json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)
            ]
    return found


def _loud(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "error")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("kind", "layer"), [("aux", "aux"), ("detached", "adapter"), ("router", "router")]
)
def test_a_disconnected_layer_is_an_error_ghost(
    runs: Runs, kind: str, layer: str, engine: str
) -> None:
    for rec in runs[f"{kind}_{engine}"]:
        assert rec["error"] is None, rec.get("traceback")
        report = rec["report"]
        assert report["failed"] is True
        (ghost,) = _loud(report)
        assert ghost["check"] == "ghost_param" and ghost["severity"] == "error", ghost
        assert ghost["module"] == layer
        assert sorted(ghost["params"]) == [f"{layer}.bias", f"{layer}.weight"]
        assert ghost["details"]["cause"] == "disconnected"
        assert ghost["details"]["ranks"] == [0, 1]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dead_layer_is_dead_not_a_ghost(runs: Runs, engine: str) -> None:
    for rec in runs[f"dead_{engine}"]:
        assert rec["error"] is None, rec.get("traceback")
        loud = _loud(rec["report"])
        assert [(f["check"], f["module"]) for f in loud] == [("dead_param", "gate")], loud


@pytest.mark.parametrize("engine", ENGINES)
def test_a_layer_whose_second_output_is_used_is_clean(runs: Runs, engine: str) -> None:
    for rec in runs[f"pair_{engine}"]:
        assert rec["error"] is None, rec.get("traceback")
        assert rec["report"]["failed"] is False and _loud(rec["report"]) == []
