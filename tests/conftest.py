"""The suite's root conftest: shared helpers on ``sys.path``, the ``pytester`` fixture.

Tests live in folders by layer (``checks/``, ``capture/``, ``report/``, ...) and import the
shared helpers in ``_helpers/`` by bare name (``from _loops import mlp``). The folder goes on
``sys.path`` here, before any test module is imported; processes started with
``multiprocessing``'s spawn (``mp.spawn``) inherit the parent's ``sys.path``, and helpers run
as scripts (``python _helpers/_dist_helpers.py ...``) put their own folder first.
"""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent / "_helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

pytest_plugins = ["pytester"]
