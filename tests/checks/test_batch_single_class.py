"""``batch_single_class``: consecutive batches of one class while the run has several.

Violating forms ("loss oscillates, model predicts the last class": ``shuffle=False`` on a
class-sorted dataset such as ImageFolder): a sorted TensorDataset behind
``DataLoader(shuffle=False)``; batches built per class in a loop; labels passed to the model
with the input (``model(x, y)``) in sorted order. Clean twins: the same data shuffled, one
class so far (a binary run's first batches being all of one class is not several),
regression targets.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _check_loops import CFG
from _fed_loops import Batch, dataset, found, loader, net, train
from torch import nn

import gradwatch

ID = "batch_single_class"


def test_an_unshuffled_loader_on_a_class_sorted_dataset() -> None:
    ld = loader(dataset(384, sort=True), shuffle=False)
    [f] = found(train(net(), lambda e: ld), ID)
    assert f.severity == "warning" and f.params == ["0.weight", "0.bias"]


def test_batches_built_class_by_class() -> None:
    ds = dataset()
    x, y = ds.tensors

    def batches(epoch: int) -> Iterator[Batch]:
        for c in range(4):
            xc = x[y == c]
            for i in range(0, len(xc) - 7, 8):
                yield xc[i : i + 8], torch.full((8,), c)

    assert found(train(net(), batches), ID)


class _Tagged(nn.Module):
    """Takes the labels with the input (a model that computes its own loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), F.one_hot(y, 4).float())


def test_labels_given_to_the_model_in_sorted_order() -> None:
    model = _Tagged()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in loader(dataset(384, sort=True), shuffle=False):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    assert found(w.report(), ID)


def test_shuffled_batches_and_float_targets_are_silent() -> None:
    ld = loader(dataset(sort=True), shuffle=True)
    assert not found(train(net(), lambda e: ld), ID)
    model = net(classes=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for x, y in loader(dataset(384, sort=True), shuffle=False):
            opt.zero_grad()
            F.mse_loss(model(x).squeeze(1), y.float()).backward()
            opt.step()
    assert not found(w.report(), ID)


def test_one_class_so_far_is_silent() -> None:
    ds = dataset(48, classes=1)
    ld = loader(ds, shuffle=False)
    assert not found(train(net(), lambda e: ld), ID)


def test_imbalanced_shuffled_batches_of_the_majority_class_are_silent() -> None:
    g = torch.Generator().manual_seed(4)
    y = (torch.rand(512, generator=g) < 0.02).long()  # 2 % positives: most batches all 0
    ds = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=g), y)
    ld = loader(ds, shuffle=True)
    assert not found(train(net(classes=2), lambda e: ld), ID)
