"""``ParamMap.from_module({"G": netG, "D": netD})``: named models mapped with the names that
gradwatch's reports use (``G:main.0.weight``), saved, selected by prefix and bound again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradwatch import ParamMap, ParamMapError


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


def test_named_models_map_with_prefixes_and_bind_to_copies() -> None:
    torch.manual_seed(0)
    netG, netD = Generator(), nn.Linear(6, 1)
    pm = ParamMap.from_module({"G": netG, "D": netD})
    assert pm.names == [
        "G:main.0.weight",
        "G:main.0.bias",
        "G:main.2.weight",
        "G:main.2.bias",
        "D:weight",
        "D:bias",
    ]
    flat = pm.flatten("data")
    assert flat.numel() == sum(p.numel() for m in (netG, netD) for p in m.parameters())

    copies = {"G": copy.deepcopy(netG), "D": copy.deepcopy(netD)}
    with torch.no_grad():
        for m in copies.values():
            for p in m.parameters():
                p.zero_()
    ParamMap.from_json(pm.to_json()).bind(copies).unflatten(flat, target="data")
    assert torch.equal(copies["G"].main[2].weight, netG.main[2].weight)

    only_g = ParamMap.from_module({"G": netG, "D": netD}, include="G:*")
    assert only_g.names == pm.names[:4]
    with pytest.raises(ParamMapError, match="model does not match the map"):
        ParamMap.from_json(pm.to_json()).bind({"G": netG})


def test_bad_named_models_are_param_map_errors() -> None:
    with pytest.raises(ParamMapError, match="model name 'G:x' may not hold ':'"):
        ParamMap.from_module({"G:x": nn.Linear(2, 2)})
    with pytest.raises(ParamMapError, match="model 'G' is a int"):
        ParamMap.from_module({"G": 3})  # type: ignore[dict-item]
