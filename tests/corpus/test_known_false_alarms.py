"""SPEC 8.1: a check is stable only when the corpus gives it no warning or error.

The corpus runs with ``preview: true`` (preview checks at their own severity), and a false
alarm it still finds is listed in ``*_known_false_alarms.tsv`` (a new one fails its program's
test). Every check listed there must therefore be preview: its findings are ``info`` for
users until the list no longer names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _harness import known_false_alarms

from gradwatch.checks.registry import preview_ids

HERE = Path(__file__).parent
LISTS = sorted(HERE.glob("*_known_false_alarms.tsv"))
NOT_A_CHECK = {"EXCEPTION"}  # gradwatch raised: a fault, not a check's verdict


def test_the_lists_exist() -> None:
    assert {p.name for p in LISTS} >= {
        "designs_known_false_alarms.tsv",
        "hf_known_false_alarms.tsv",
    }


@pytest.mark.parametrize("path", LISTS, ids=[p.stem for p in LISTS])
def test_every_check_a_list_names_is_preview(path: Path) -> None:
    named = {c for checks in known_false_alarms(path).values() for c in checks}
    assert not named & NOT_A_CHECK, f"{path.name}: gradwatch itself failed on a correct program"
    stable = sorted(named - preview_ids())
    assert not stable, f"{path.name} lists false alarms of stable checks: {stable}"
