"""The parameter index stays linear in the parameters of one layer (10k+ in a ParameterList)."""

from __future__ import annotations

import time

import torch
from torch import nn

from gradwatch.model.index import ParamIndex


def test_names_of_one_big_layer_are_linear() -> None:
    # Was a membership test in a list: 40k tensors in one ParameterList took 5 s.
    model = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(40_000)])
    index = ParamIndex()
    idxs = index.scan_model(model)
    start = time.perf_counter()
    names = index.names(idxs)
    elapsed = time.perf_counter() - start
    assert names == [n for n, _ in model.named_parameters()]
    assert elapsed < 1.0, f"names() of 40k parameters took {elapsed:.2f} s"
