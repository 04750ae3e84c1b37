"""``one_thread``: an autouse fixture for tests of tiny models (probes and their sweeps).

One thread is faster than several on a shared CI machine (idle OpenMP threads spin) and keeps
each test to a fraction of a second. Import it into a conftest or test module to apply it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

__all__ = ["one_thread"]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
