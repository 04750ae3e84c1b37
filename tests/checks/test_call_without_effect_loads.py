"""``call_without_effect``: a ``strict=False`` load made before ``watch()`` began.

The most common form of the misload: the checkpoint is loaded while the model is built, then
the loop is watched. Violating forms, as practitioners report them: a fine-tuning script
loading a ``DataParallel`` checkpoint (``module.`` keys, pytorch/pytorch#3805) with
``strict=False`` to tolerate its new head; a Lightning checkpoint's ``model.`` keys; a
``torch.compile``d model's ``_orig_mod.`` keys; a timm/HF backbone checkpoint whose keys name
the backbone (``backbone.``) loaded into the encoder. Clean twins: a fine-tuning load where
only the new head is missing, ``strict=True`` loads, a load into another model, a correct
load of a module the watcher also watches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _check_loops import CFG
from torch import nn

import gradwatch
from gradwatch import _loads

ID = "call_without_effect"


class Net(nn.Module):
    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def _train(model: nn.Module, steps: int = 3) -> list[Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for _ in range(steps):
            x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return [f for f in w.report().findings if f.check == ID]


def _pretrained(prefix: str, classes: int = 10) -> dict[str, torch.Tensor]:
    """A checkpoint of the same network trained on ``classes`` classes, keys under ``prefix``."""
    return {prefix + k: v for k, v in Net(classes).state_dict().items()}


@pytest.fixture(autouse=True)
def _no_loads_left() -> Any:
    _loads.take(lambda m: True)  # loads of earlier tests into their own models
    yield


def test_loads_are_kept_from_import() -> None:
    assert _loads.wrapped(nn.Module)  # the pytest plugin imported gradwatch


@pytest.mark.parametrize("prefix", ["module.", "model.", "_orig_mod."])
def test_a_prefixed_checkpoint_loaded_before_the_watch(prefix: str) -> None:
    torch.manual_seed(0)
    model = Net()
    # strict=False because the new head differs: every key misses, silently
    result = model.load_state_dict(_pretrained(prefix), strict=False)
    assert "enc.0.weight" in result.missing_keys
    (f,) = _train(model)
    assert f.severity == "warning" and f.details["kind"] == "load_state_dict"
    assert f.details["before_watch"] is True and f.details["loaded"] == 0
    assert f.details["pairs"][0] == ["enc.0.weight", prefix + "enc.0.weight"]
    assert "test_call_without_effect_loads.py" in f.details["called_at"]
    assert "before watch() began" in f.message
    assert "enc.0.weight" in f.params and "head.weight" in f.params
    assert f.first_step == 0  # judged at the first step


def test_a_prefixed_backbone_loaded_into_the_encoder_before_the_watch() -> None:
    model = Net()
    backbone = {"backbone." + k: v for k, v in Net().enc.state_dict().items()}
    model.enc.load_state_dict(backbone, strict=False)
    (f,) = _train(model)
    assert f.module == "enc" and f.details["pairs"][0] == ["0.weight", "backbone.0.weight"]
    assert "enc.2.weight" in f.params and "head.weight" not in f.params


def test_a_checkpoint_with_the_prefix_dropped_loaded_into_a_wrapper() -> None:
    class Lit(nn.Module):  # a LightningModule-like wrapper holding the net as `model`
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    lit = Lit()
    lit.load_state_dict(Net().state_dict(), strict=False)  # saved from the bare net
    (f,) = _train(lit)
    assert f.details["pairs"][0] == ["model.enc.0.weight", "enc.0.weight"]


def test_a_fine_tuning_load_with_only_the_new_head_missing_is_silent() -> None:
    model = Net()
    saved = {k: v for k, v in _pretrained("").items() if not k.startswith("head.")}
    saved["fc.weight"], saved["fc.bias"] = torch.zeros(10, 16), torch.zeros(10)  # old head
    result = model.load_state_dict(saved, strict=False)
    assert result.missing_keys == ["head.weight", "head.bias"]
    assert not _train(model)


def test_strict_loads_and_loads_into_other_models_are_silent() -> None:
    model, other = Net(), Net()
    model.load_state_dict(Net().state_dict())  # strict=True
    other.load_state_dict(_pretrained("module."), strict=False)  # not the watched model
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(_pretrained("module."))  # strict: the user sees it
    assert not _train(model)
    (f,) = _train(other)  # still kept for the model it went into
    assert f.details["before_watch"] is True


def test_a_load_is_judged_by_the_first_watch_only() -> None:
    model = Net()
    model.load_state_dict(_pretrained("module."), strict=False)
    assert len(_train(model)) == 1
    assert not _train(model)  # a watch per epoch: the second one does not report it again


def test_a_load_during_the_watch_is_judged_once() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config=CFG) as w:
        model.load_state_dict(_pretrained("module."), strict=False)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    (f,) = [f for f in w.report().findings if f.check == ID]
    assert f.details["before_watch"] is False
    assert not _train(model)  # not kept for a later watcher


def test_a_load_into_a_frozen_backbone_is_judged_at_the_step() -> None:
    model = Net()
    model.enc.load_state_dict(
        {"backbone." + k: v for k, v in Net().enc.state_dict().items()}, strict=False
    )
    model.enc.requires_grad_(False)  # frozen after loading: no trained weight missed
    assert not _train(model)
