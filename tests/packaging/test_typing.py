"""mypy checks a user's code against the installed wheel (issue 15: typing).

A user's script, in a folder of its own, type-checked with mypy pointed at the venv where
``.ci/wheel`` installed the wheel: correct usage passes, a misspelt name and a wrongly typed
call fail, ``Watcher.report()`` is a ``Report``, and every public name is visible to mypy.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _wheel import InstalledWheel, installed_wheel, user_env

import gradwatch

pytestmark = pytest.mark.slow

GOOD = """\
from __future__ import annotations

from typing import assert_type

import torch

import gradwatch
from gradwatch import GradWatchConfig, Report, Watcher

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
config = GradWatchConfig.model_validate({"fail_on": "warning", "every_n_steps": 1})
with gradwatch.watch(model, opt, config=config) as watcher:
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
assert_type(watcher, Watcher)
report = watcher.report()
assert_type(report, Report)
steps: int = report.steps
checks: list[str] = [f.check for f in report.findings]
"""

# The README's way to build a config. Without pydantic's mypy plugin (a user's default), mypy
# reads GradWatchConfig through dataclass_transform, which only sees `Field(default=...)`:
# fields declared as `Field(False, ...)` look required.
CONFIG = """\
from gradwatch import GradWatchConfig

config = GradWatchConfig(fail_on="warning", every_n_steps=1)
"""

BAD = """\
from __future__ import annotations

import torch

import gradwatch

gradwatch.typo()
watcher = gradwatch.watch(42)
steps: str = watcher.report().steps
"""


def _mypy(built: InstalledWheel, folder: Path, *files: str) -> subprocess.CompletedProcess[str]:
    (folder / "mypy.ini").write_text("[mypy]\n")  # mypy's defaults, not this repository's
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--python-executable",
            str(built.bin("python")),
            "--cache-dir",
            str(folder / ".mypy_cache"),
            "--no-error-summary",
            *files,
        ],
        capture_output=True,
        text=True,
        cwd=folder,
        env=user_env(),
        timeout=600,
    )


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mypy's errors per user script (one run for all of them: mypy reads torch once)."""
    built = installed_wheel(tmp_path_factory)
    folder = tmp_path_factory.mktemp("user")
    (folder / "good.py").write_text(GOOD)
    (folder / "bad.py").write_text(BAD)
    (folder / "config_kwargs.py").write_text(CONFIG)
    names = "\n".join(f"_{i} = gradwatch.{n}" for i, n in enumerate(gradwatch.__all__))
    (folder / "names.py").write_text(f"import gradwatch\n\n{names}\n")
    files = ["good.py", "bad.py", "names.py", "config_kwargs.py"]
    proc = _mypy(built, folder, *files)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    found: dict[str, list[str]] = {f: [] for f in files}
    for line in proc.stdout.splitlines():
        m = re.match(r"(\w+\.py):(\d+): error: (.*)", line)
        assert m is not None or ": note: " in line, line
        if m:
            found[m[1]].append(f"{m[2]}: {m[3]}")
    return found


def test_correct_usage_type_checks(checked: dict[str, list[str]]) -> None:
    # assert_type fails unless report() is exactly Report (it was Any) and watch() a Watcher
    assert checked["good.py"] == []


def test_a_misspelt_name_and_wrong_types_fail(checked: dict[str, list[str]]) -> None:
    errors = checked["bad.py"]
    assert any(e.startswith('7: Module has no attribute "typo"') for e in errors), errors
    assert any(
        e.startswith('8: Argument 1 to "watch" has incompatible type "int"') for e in errors
    ), errors
    assert any(e.startswith("9: Incompatible types in assignment") for e in errors), errors
    assert "Cannot find implementation" not in "\n".join(errors)  # the package was found


def test_every_public_name_is_visible_to_mypy(checked: dict[str, list[str]]) -> None:
    # a name added to the lazy table without its TYPE_CHECKING import would fail here
    assert checked["names.py"] == []


def test_config_keywords_type_check_without_the_pydantic_plugin(
    checked: dict[str, list[str]],
) -> None:
    assert checked["config_kwargs.py"] == []
