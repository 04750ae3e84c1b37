"""The suite's root conftest: shared helpers on ``sys.path``, the ``floor`` marker, ``pytester``.

Tests live in folders by layer (``checks/``, ``capture/``, ``report/``, ...) and import the
shared helpers in ``_helpers/`` by bare name (``from _loops import mlp``). The folder goes on
``sys.path`` here, before any test module is imported; processes started with
``multiprocessing``'s spawn (``mp.spawn``) inherit the parent's ``sys.path``, and helpers run
as scripts (``python _helpers/_dist_helpers.py ...``) put their own folder first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
HELPERS = str(TESTS / "_helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

from _examples import RunExample  # noqa: E402 (the helpers folder is on sys.path only now)

pytest_plugins = ["pytester"]

# A pytest-xdist worker (`.ci/test` runs the suite on one per core): it gets COLUMNS=80 and
# LINES=24 from execnet, which a serial run has not (the console tests read the width of a
# non-terminal: 110), and two workers each running torch on two threads oversubscribe the two
# cores of CI (a transformers corpus test took 5 x longer). One thread per worker, and the
# environment a serial run has; subprocesses inherit both.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# Folders whose every test depends on a package .ci/floor pins to its lowest version (config
# files: pydantic, pyyaml; rendering: rich, matplotlib, tensorboard; Lightning, transformers,
# accelerate, jsonargparse; the examples use them all). Tests elsewhere that use one of them
# carry ``@pytest.mark.floor`` themselves: in cli/, the CLI's own output (test_cli.py) and the
# pytest plugin and fixture (pytest); its selection, baseline, SARIF and isolation tests run
# the same code on any version of those, so only the main run runs them.
FLOOR_FOLDERS = frozenset({"config", "report", "integrations", "examples"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a pytester suite's own tests, outside this folder
            continue
        if folder in FLOOR_FOLDERS:
            item.add_marker(pytest.mark.floor)


@pytest.fixture(scope="session")
def run_example(tmp_path_factory: pytest.TempPathFactory) -> RunExample:
    """``run_example("demo.py")``: examples/demo.py run once per session, in a folder of its own.

    Several tests read the same script's run (every example exits 0; the Lightning one prints
    its ghost): a fresh Python that imports torch (and Lightning) costs seconds, so the run is
    shared, not repeated. Warnings are off as for a user who runs the script.
    """
    done: dict[str, subprocess.CompletedProcess[str]] = {}

    def run(name: str) -> subprocess.CompletedProcess[str]:
        if name not in done:
            done[name] = subprocess.run(
                [sys.executable, str(EXAMPLES / name)],
                cwd=tmp_path_factory.mktemp(Path(name).stem),
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
                capture_output=True,
                text=True,
                timeout=300,
            )
        return done[name]

    return run
