"""The built distribution holds everything a user needs (issue 21).

Everything else in the suite runs against the working tree; these tests look at the wheel and
sdist that ``python -m build`` makes and at the venv ``.ci/wheel`` installed the wheel into.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from _wheel import ROOT, InstalledWheel, installed_wheel, user_env

from gradwatch._version import __version__

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    return installed_wheel(tmp_path_factory)


def _sources() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "gradwatch").rglob("*.py")}


def _dist_info(names: list[str], file: str) -> str:
    (name,) = [n for n in names if n.endswith(f".dist-info/{file}")]
    return name


def test_wheel_holds_every_module_py_typed_and_the_license(built: InstalledWheel) -> None:
    with zipfile.ZipFile(built.wheel) as zf:
        names = zf.namelist()
    missing = _sources() - set(names)
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    assert "gradwatch/py.typed" in names
    assert _dist_info(names, "licenses/LICENSE")
    # nothing from outside the package: tests, examples, benchmarks stay in the sdist only
    assert {n.split("/")[0] for n in names} == {"gradwatch", f"gradwatch-{__version__}.dist-info"}


def test_wheel_declares_the_console_script_and_the_pytest_plugin(built: InstalledWheel) -> None:
    with zipfile.ZipFile(built.wheel) as zf:
        names = zf.namelist()
        text = zf.read(_dist_info(names, "entry_points.txt")).decode()
    eps = configparser.ConfigParser()
    eps.read_string(text)
    assert dict(eps["console_scripts"]) == {"gradwatch": "gradwatch.cli:main"}
    assert dict(eps["pytest11"]) == {"gradwatch": "gradwatch.pytest_plugin"}
    # and the installed venv resolves both to the wheel's modules, not the working tree's
    # (find_spec, not load: the plugin imports pytest, which a user's venv may not have)
    code = (
        "from importlib.metadata import entry_points as e\n"
        "from importlib.util import find_spec\n"
        "for group, name in (('pytest11', 'gradwatch'), ('console_scripts', 'gradwatch')):\n"
        "    print(find_spec(e(group=group)[name].module).origin)\n"
    )
    out = subprocess.run(
        [str(built.bin("python")), "-P", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=user_env(),
        cwd=built.venv,
    ).stdout.split()
    assert [Path(p).relative_to(built.venv).parts[-2:] for p in out] == [
        ("gradwatch", "pytest_plugin.py"),
        ("cli", "__init__.py"),
    ]


def test_metadata_says_what_is_tested(built: InstalledWheel) -> None:
    with zipfile.ZipFile(built.wheel) as zf:
        meta = Parser().parsestr(zf.read(_dist_info(zf.namelist(), "METADATA")).decode())
    assert meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = set(meta.get_all("Classifier"))
    assert {"Typing :: Typed", "Operating System :: OS Independent"} <= classifiers
    # Python versions: exactly the one CI runs on, which is also the declared floor
    tested = f"{sys.version_info.major}.{sys.version_info.minor}"
    versions = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert versions == {tested}
    assert meta["Requires-Python"] == f">={tested}"
    assert meta["Description-Content-Type"] == "text/markdown"


def test_sdist_holds_the_license_changelog_and_every_module(built: InstalledWheel) -> None:
    with tarfile.open(built.sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    assert _sources() <= names


def test_version_flag_matches_the_package_version(built: InstalledWheel, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(built.bin("gradwatch")), "--version"],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"gradwatch {__version__}"
