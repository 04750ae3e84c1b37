"""Every script under examples/ runs and exits 0 (the README points people at them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _examples import RunExample

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))
SLOW = {"lightning_ghost.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
        for p in EXAMPLES
    ],
)
def test_example_runs(script: Path, run_example: RunExample) -> None:
    proc = run_example(script.name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_demo_finds_its_three_bugs_and_prints_the_readmes_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sys.path.insert(0, str(EXAMPLES[0].parent))
    try:
        import demo
    finally:
        sys.path.pop(0)
    root = EXAMPLES[0].parents[1]
    monkeypatch.chdir(root)  # as `bash .ci/demo` runs it: paths relative to the clone
    monkeypatch.setenv("COLUMNS", "96")
    report = demo.main(tmp_path)
    causes = {f.module: f.details["cause"] for f in report.by_check("ghost_param")}
    assert causes == {"aux_head": "not_called", "text_proj": "no_grad", "pooler": "disconnected"}
    assert (tmp_path / "gradwatch-report.json").exists()
    # The README's "What gradwatch finds" shows this very output (a real run, COLUMNS=96).
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## What gradwatch finds") :]
    picture = section.split("```\n", 2)[1]
    assert picture.strip() and picture in capsys.readouterr().out
