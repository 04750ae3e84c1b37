"""The built wheel, installed (not editable) into a fresh venv: shared by the packaging tests.

``.ci/test`` runs ``.ci/wheel`` first and passes what it built through ``GRADWATCH_DIST`` and
``GRADWATCH_WHEEL_VENV``; without them, the first test that asks runs ``.ci/wheel`` itself
into a temporary folder (a few minutes: a fresh venv gets torch and the extras).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class InstalledWheel:
    """What ``.ci/wheel`` made: the folder with the sdist and wheel, and the venv."""

    dist: Path
    venv: Path

    @property
    def wheel(self) -> Path:
        (wheel,) = self.dist.glob("gradwatch-*.whl")
        return wheel

    @property
    def sdist(self) -> Path:
        (sdist,) = self.dist.glob("gradwatch-*.tar.gz")
        return sdist

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name


_built: list[InstalledWheel] = []  # one build per session, shared by every test module


def user_env() -> dict[str, str]:
    """The environment of a user's shell: nothing that points Python at the working tree."""
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "MYPYPATH"}}


def installed_wheel(factory: pytest.TempPathFactory) -> InstalledWheel:
    if _built:
        return _built[0]
    dist, venv = os.environ.get("GRADWATCH_DIST"), os.environ.get("GRADWATCH_WHEEL_VENV")
    if dist and venv and (Path(venv) / "bin" / "python").exists():
        made = InstalledWheel(Path(dist), Path(venv))
    else:
        tmp = factory.mktemp("wheel")
        made = InstalledWheel(tmp / "dist", tmp / "venv")
        env = {
            **user_env(),
            "GRADWATCH_DIST": str(made.dist),
            "GRADWATCH_WHEEL_VENV": str(made.venv),
            "GRADWATCH_BUILD_PYTHON": sys.executable,
            "PYTHON": getattr(sys, "_base_executable", sys.executable),
        }
        proc = subprocess.run(
            ["bash", str(ROOT / ".ci" / "wheel")],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _built.append(made)
    return made
