"""``gradwatch explain``, ``--sarif`` (SARIF 2.1.0) and ``--baseline`` on the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradwatch.checks import ALL_CHECKS
from gradwatch.checks.docs import DOCS
from gradwatch.checks.explain import all_docs, lookup
from gradwatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GHOST = str(ROOT / "examples" / "ci_ghost.py") + ":build"
CLEAN = str(ROOT / "examples" / "ci_clean.py") + ":build"
# `check` runs --in-process here: these tests are about the outputs, and a child per run would
# import torch again (3 s); the isolation itself is tests/cli/test_check_isolation.py.

# Every id of SPEC §2 and §5: explain must know each, implemented yet or not.
SPEC_IDS = [
    "ghost_param",
    "missing_zero_grad",
    "step_without_grad",
    "nonfinite_grad",
    "exploding_grad",
    "vanishing_grad",
    "dead_param",
    "stale_param",
    "not_in_optimizer",
    "frozen_in_optimizer",
    "loss_disconnected",
    "double_update",
    "unregistered_param",
    "frozen_param_updated",
    "clipped_while_scaled",
    "not_observed",
]
SECTIONS = ["Why it matters:", "Common causes:", "How to fix:", "How to silence it:"]


# -- explain ---------------------------------------------------------------------------------


@pytest.mark.parametrize("check", sorted(set(SPEC_IDS) | set(all_docs())))
def test_explain_every_id(check: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", check]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{check} (default severity: ")
    positions = [out.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    for section in out.split("\n\n")[1:]:  # no empty section
        assert len(section.split()) > 3, section
    assert f"checks: {{{check}: {{enabled: false}}}}" in out and "--baseline" in out


def test_registered_checks_are_documented_once() -> None:
    for cls in ALL_CHECKS:
        # Its own ``doc``, or (a check added later) the table's entry: never two texts.
        assert cls.doc is not None or cls.id in DOCS, cls.id
        assert cls.doc is None or cls.id not in DOCS or cls.doc is DOCS[cls.id], cls.id
        assert lookup(cls.id) is (cls.doc or DOCS[cls.id])


def test_explain_unknown_id_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "ghost_params"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "unknown check 'ghost_params'" in captured.err and "'ghost_param'" in captured.err


def test_explain_without_id_lists_every_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    starts = {line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")}
    assert set(SPEC_IDS) <= starts


# -- SARIF -----------------------------------------------------------------------------------


def _validate_sarif(log: dict[str, Any]) -> None:
    """The required structure of SARIF 2.1.0 (sarifLog, run, tool, rule, result, location)."""
    assert log["version"] == "2.1.0"
    assert log["$schema"].endswith("sarif-2.1.0.json")
    assert isinstance(log["runs"], list) and log["runs"]
    for run in log["runs"]:
        driver = run["tool"]["driver"]
        assert isinstance(driver["name"], str) and driver["name"]
        rules = driver["rules"]
        ids = [r["id"] for r in rules]
        assert len(ids) == len(set(ids)), "one rule per check id"
        for rule in rules:
            assert rule["shortDescription"]["text"]
            level = rule.get("defaultConfiguration", {}).get("level", "warning")
            assert level in ("none", "note", "warning", "error")
        for base in run.get("originalUriBaseIds", {}).values():
            assert base["uri"].startswith("file://") and base["uri"].endswith("/")
        for result in run["results"]:
            assert isinstance(result["message"]["text"], str) and result["message"]["text"]
            assert result["ruleId"] in ids
            assert ids[result["ruleIndex"]] == result["ruleId"]
            assert result["level"] in ("none", "note", "warning", "error")
            for loc in [*result.get("locations", []), *result.get("relatedLocations", [])]:
                assert set(loc) & {"physicalLocation", "logicalLocations", "message", "id"}
                phys = loc.get("physicalLocation")
                if phys is not None:
                    art = phys["artifactLocation"]
                    assert isinstance(art["uri"], str) and art["uri"]
                    if "uriBaseId" in art:
                        assert art["uriBaseId"] in run["originalUriBaseIds"]
                    assert isinstance(phys["region"]["startLine"], int)
                    assert phys["region"]["startLine"] >= 1
                for logical in loc.get("logicalLocations", []):
                    assert logical["name"]
            if "baselineState" in result:
                assert result["baselineState"] in ("new", "unchanged", "updated", "absent")
            for value in result.get("partialFingerprints", {}).values():
                assert isinstance(value, str)


def test_sarif_from_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out" / "gradwatch.sarif"
    assert main(["check", "--in-process", GHOST, "--sarif", str(out)]) == 1
    log = json.loads(out.read_text(encoding="utf-8"))
    _validate_sarif(log)
    run = log["runs"][0]
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert rules[: len(ALL_CHECKS)] == [c.id for c in ALL_CHECKS]
    (result,) = run["results"]
    assert result["ruleId"] == "ghost_param" and result["level"] == "error"
    assert "aux_head" in result["message"]["text"] and "Hint:" in result["message"]["text"]
    loc = result["locations"][0]
    assert loc["physicalLocation"]["artifactLocation"]["uri"].endswith("examples/ci_ghost.py")
    source = (ROOT / "examples" / "ci_ghost.py").read_text(encoding="utf-8").splitlines()
    line = loc["physicalLocation"]["region"]["startLine"]
    assert source[line - 1].strip().startswith("self.aux_head = nn.Linear(")
    assert loc["logicalLocations"][0]["name"] == "aux_head"
    assert "baselineState" not in result  # no baseline given


def test_sarif_from_report_with_overfit_rule_and_no_locations(tmp_path: Path) -> None:
    saved, sarif = tmp_path / "r.json", tmp_path / "r.sarif"
    assert main(["check", "--in-process", CLEAN, "--json", str(saved)]) == 0
    assert main(["report", str(saved), "--sarif", str(sarif)]) == 0
    log = json.loads(sarif.read_text(encoding="utf-8"))
    _validate_sarif(log)
    assert log["runs"][0]["results"] == []


def test_sarif_unwritable_target_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["check", "--in-process", CLEAN, "--sarif", str(blocker / "x.sarif")]) == 2
    assert "cannot write SARIF" in capsys.readouterr().err


# -- baseline --------------------------------------------------------------------------------


def test_baseline_accepts_known_findings_and_fails_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    known = tmp_path / "baseline.json"
    assert main(["check", "--in-process", GHOST, "--json", str(known)]) == 1
    capsys.readouterr()
    # The same finding, seen at other steps (5 steps instead of 3): accepted.
    again = tmp_path / "again.json"
    sarif = tmp_path / "again.sarif"
    args = ["check", "--in-process", GHOST, "--steps", "5", "--baseline", str(known)]
    assert main([*args, "--json", str(again), "--sarif", str(sarif)]) == 0
    out = capsys.readouterr().out
    assert "error[ghost_param]" not in out
    assert out.rstrip().endswith("1 in the baseline, fail_on=error")
    saved = json.loads(again.read_text(encoding="utf-8"))
    assert saved["failed"] is False and saved["findings"][0]["details"]["baselined"] is True
    (result,) = json.loads(sarif.read_text(encoding="utf-8"))["runs"][0]["results"]
    assert result["baselineState"] == "unchanged"
    # A baseline from a clean run knows nothing: the ghost is new and fails.
    clean = tmp_path / "clean.json"
    assert main(["check", "--in-process", CLEAN, "--json", str(clean)]) == 0
    assert main(["check", "--in-process", GHOST, "--baseline", str(clean)]) == 1
    assert "error[ghost_param]" in capsys.readouterr().out
    # gradwatch report applies it too.
    assert main(["report", str(known), "--baseline", str(known)]) == 0
    assert main(["report", str(known), "--baseline", str(clean)]) == 1


def test_baseline_matches_on_layer_not_steps_and_new_layer_fails(tmp_path: Path) -> None:
    import gradwatch

    known = tmp_path / "known.json"
    assert main(["check", "--in-process", GHOST, "--json", str(known)]) == 1
    base = gradwatch.Report.read(known)
    current = base.model_copy(deep=True)
    moved = current.findings[0]
    moved.first_step, moved.last_step, moved.count = 40, 90, 51
    assert not current.with_baseline(base).failed
    other = moved.model_copy(update={"module": "other_head", "params": ["other_head.weight"]})
    current.findings.append(other)
    judged = current.with_baseline(base)
    assert judged.failed
    assert [f.module for f in judged.failing()] == ["other_head"]
    with pytest.raises(gradwatch.GhostLayerError, match="other_head"):
        judged.raise_for_findings()


def test_missing_baseline_is_exit_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--in-process", GHOST, "--baseline", str(tmp_path / "nope.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot read report" in captured.err
