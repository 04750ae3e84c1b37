"""The clean corpus (SPEC 8.1): correct programs that must get no warning or error.

Every test here is marked ``corpus``; the transformers half also ``slow`` where it is long.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "corpus" in item.path.parts:
            item.add_marker(pytest.mark.corpus)
