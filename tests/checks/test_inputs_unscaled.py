"""``inputs_unscaled``: the model's float input is far from a normalised scale.

Violating forms ("forgot to normalize inputs, loss stuck / NaN"): a tabular batch with an
income in dollars beside ratios in [0, 1] fed to a first Linear; raw 0..255 pixel values
as floats into a conv net (``torch.tensor(img).float()``, no ``ToTensor``); house-price
features (square feet, year, rooms) unstandardised. Clean twins: standardised columns,
images divided by 255 and normalised, token ids into an embedding, one-hot features, a
BatchNorm/LayerNorm as the first layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from _check_loops import CFG
from _fed_loops import Batch, found, net, train
from torch import nn

import gradwatch

ID = "inputs_unscaled"
G = torch.Generator().manual_seed(5)


def _tab(scales: list[float], steps: int = 4) -> Iterator[Batch]:
    s = torch.tensor(scales)
    for _ in range(steps):
        x = torch.rand(32, len(scales), generator=G) * s
        yield x, torch.randint(0, 4, (32,), generator=G)


def test_income_in_dollars_beside_ratios() -> None:
    scales = [50_000.0, 1.0, 0.5, 1.0, 1.0, 0.8, 1.0, 1.0]
    [f] = found(train(net(), lambda e: _tab(scales)), ID)
    assert f.severity == "warning" and f.params == ["0.weight", "0.bias"] and f.module == "0"
    assert f.details["feature_max"] == 0


def test_house_features_unstandardised() -> None:
    scales = [3000.0, 2020.0, 6.0, 4.0, 1.0, 1.0, 1.0, 1.0]
    assert found(train(net(), lambda e: _tab(scales)), ID)


def _images(scale: float, norm: bool = False) -> Iterator[Batch]:
    for _ in range(4):
        x = (torch.rand(8, 3, 16, 16, generator=G) * 255).round()
        if norm:
            x = (x / 255 - 0.5) / 0.25
        yield x * scale, torch.randint(0, 4, (8,), generator=G)


def _cnn(first: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    layers = [first] if first is not None else []
    return nn.Sequential(*layers, nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(784, 4))


def test_raw_pixels_as_floats_into_a_conv_net() -> None:
    [f] = found(train(_cnn(), lambda e: _images(1.0)), ID)
    assert f.module == "0" and f.details["max"] > 10


def test_normalised_inputs_are_silent() -> None:
    assert not found(train(_cnn(), lambda e: _images(1.0, norm=True)), ID)
    assert not found(train(net(), lambda e: _tab([1.0] * 8)), ID)


def test_a_normalisation_layer_first_is_silent() -> None:
    assert not found(train(_cnn(nn.BatchNorm2d(3)), lambda e: _images(1.0)), ID)
    first = nn.LayerNorm(8)
    assert not found(train(net(first=first), lambda e: _tab([5e4] + [1.0] * 7)), ID)


def test_token_ids_and_one_hot_are_silent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 8), nn.Flatten(), nn.Linear(40, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for _ in range(4):
            ids = torch.randint(0, 1000, (16, 5), generator=G)
            opt.zero_grad()
            F.cross_entropy(model(ids), torch.randint(0, 4, (16,), generator=G)).backward()
            opt.step()
    assert not found(w.report(), ID)
    hot = F.one_hot(torch.randint(0, 8, (4, 32), generator=G), 8).float()
    assert not found(train(net(), lambda e: ((h, h.argmax(1) % 4) for h in hot)), ID)
