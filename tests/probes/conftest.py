"""Probe tests run tiny models: one thread is faster than several on a shared CI machine
(idle OpenMP threads spin), and keeps each test to a fraction of a second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
