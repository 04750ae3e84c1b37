"""Shared by the data_as_fed checks' tests: a small classifier, a dataset and the loop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradwatch

Batch = tuple[torch.Tensor, torch.Tensor]


def net(inp: int = 8, classes: int = 4, first: Optional[nn.Module] = None) -> nn.Module:
    torch.manual_seed(0)
    layers = [first] if first is not None else []
    return nn.Sequential(*layers, nn.Linear(inp, 16), nn.ReLU(), nn.Linear(16, classes))


def dataset(n: int = 128, inp: int = 8, classes: int = 4, sort: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, inp, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    if sort:
        order = torch.argsort(y, stable=True)
        x, y = x[order], y[order]
    return TensorDataset(x, y)


def loader(ds: TensorDataset, shuffle: bool = True, bs: int = 16) -> DataLoader[Any]:
    return DataLoader(
        ds, batch_size=bs, shuffle=shuffle, generator=torch.Generator().manual_seed(2)
    )


def train(
    model: nn.Module,
    batches: Callable[[int], Iterable[Batch]],
    *,
    epochs: int = 1,
    evaluate: Optional[Callable[[], Iterable[Batch]]] = None,
) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={**CFG, "preview": True}) as w:
        for epoch in range(epochs):
            model.train()
            for x, y in batches(epoch):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            if evaluate is not None:
                model.eval()
                with torch.no_grad():
                    for x, _ in evaluate():
                        model(x)
    return w.report()


def found(report: Any, check: str) -> list[Any]:
    return [f for f in report.findings if f.check == check]
