"""``frozen_stats_updated``: frozen norm layers whose running statistics keep moving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _regime import DIM, LossOf, hf_train, lightning_fit, plain_loop, problems
from torch import nn

import gradwatch
from gradwatch.checks.frozen_stats import FrozenStatsUpdated

ID = FrozenStatsUpdated.id


class Detector(nn.Module):
    """A pretrained conv/BN backbone frozen for fine-tuning, and a trainable head."""

    def __init__(self, keep_bn_eval: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.keep_bn_eval = keep_bn_eval
        self.backbone = nn.Sequential(
            nn.Linear(DIM, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
        )
        self.backbone.requires_grad_(False)  # frozen parameters only
        self.head = nn.Linear(16, 1)
        self.train()

    def train(self, mode: bool = True) -> Detector:
        super().train(mode)
        if self.keep_bn_eval:  # the fix: frozen BN stays in eval
            for m in self.backbone.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_frozen_backbone_batch_norms_back_in_train_mode() -> None:
    model = Detector()
    before = model.backbone[1].running_mean.clone()
    report = plain_loop(model, torch.optim.SGD(_trainable(model), lr=0.01), steps=4)
    assert not torch.equal(before, model.backbone[1].running_mean)  # they did move
    (f,) = report.by_check(ID)
    # from step 1: a flagged layer is reported once a later step finds its affine values unchanged
    # (an EMA target moves them, and is not frozen)
    assert f.severity == "warning" and f.first_step == 1 and f.count == 3
    assert f.details["modules"] == ["backbone.1", "backbone.4"]
    assert f.module == "backbone"
    assert sorted(f.params) == [
        "backbone.1.bias",
        "backbone.1.weight",
        "backbone.4.bias",
        "backbone.4.weight",
    ]


def test_freezing_after_the_optimizer_with_model_train_each_epoch() -> None:
    """Linear probing: ``for p in backbone.parameters(): p.requires_grad = False`` and a loop
    that calls ``model.train()`` every epoch."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU())
    for p in backbone.parameters():
        p.requires_grad = False
    model = nn.Sequential(backbone, nn.Linear(16, 1))
    opt = torch.optim.SGD(_trainable(model), lr=0.01)
    (f,) = plain_loop(model, opt, steps=3, after_step=lambda s: model.train()).by_check(ID)
    assert f.details["modules"] == ["0.1"]


def test_look_alikes_are_silent() -> None:
    fixed = Detector(keep_bn_eval=True)  # a train() override keeps them in eval
    assert problems(plain_loop(fixed, torch.optim.SGD(_trainable(fixed), lr=0.01))) == []
    trainable = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    assert problems(plain_loop(trainable, torch.optim.SGD(trainable.parameters(), lr=0.01))) == []
    no_affine = nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16, affine=False), nn.Linear(16, 1)
    )
    assert not plain_loop(no_affine, torch.optim.SGD(no_affine.parameters(), lr=0.01)).by_check(ID)
    frozen_stats = nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16, momentum=0.0), nn.Linear(16, 1)
    )
    frozen_stats[1].requires_grad_(False)
    opt = torch.optim.SGD(_trainable(frozen_stats), lr=0.01)
    assert not plain_loop(frozen_stats, opt).by_check(ID)  # momentum 0: the stats never move


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.FrozenBatchNorm2d as it is written: statistics and affine as buffers."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)


def test_frozen_batch_norm_as_torchvision_writes_it_is_silent() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), FrozenBatchNorm2d(4), nn.Flatten(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt) as w:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3, 6, 6, generator=g)).pow(2).mean().backward()
            opt.step()
    assert problems(w.report()) == []


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_trains_a_frozen_backbone_with_its_batch_norms_in_train(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    (f,) = lightning_fit(Detector(), tmp_path, validate=True).by_check(ID)
    assert f.details["modules"] == ["net.backbone.1", "net.backbone.4"]


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:Found .* in eval mode at the start of training")
def test_lightning_frozen_backbone_kept_in_eval_is_silent(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    assert problems(lightning_fit(Detector(keep_bn_eval=True), tmp_path, validate=True)) == []


def test_hf_trainer_calls_train_on_a_frozen_backbone(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (f,) = hf_train(LossOf(Detector()), tmp_path, evaluate=True).by_check(ID)
    assert f.details["modules"] == ["net.backbone.1", "net.backbone.4"]
    fixed = hf_train(LossOf(Detector(keep_bn_eval=True)), tmp_path, evaluate=True)
    assert problems(fixed) == []


def _byol_like() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)

    def encoder() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    online = encoder()
    model = nn.ModuleDict({"online": online, "target": encoder()})
    model["target"].load_state_dict(online.state_dict())
    model["target"].requires_grad_(False)  # moved by the EMA below, not by the optimizer
    opt = torch.optim.SGD(online.parameters(), lr=0.05)
    return model, online, opt


@pytest.mark.parametrize("update", ["lerp", "data_assign"])
def test_an_ema_target_in_train_mode_is_not_frozen(update: str) -> None:
    """BYOL / MoCo / mean teacher: the target encoder's parameters do not require grad but
    the program moves them every step (``torch._foreach_lerp_``; MoCo's ``p.data = ...``),
    and its batch norms run in train mode on purpose."""
    model, online, opt = _byol_like()
    target = model["target"]
    with gradwatch.watch(model, opt) as w:
        for _ in range(6):
            x = torch.randn(16, 8)
            opt.zero_grad()
            p = online(x)
            with torch.no_grad():
                z = target(x + 0.1 * torch.randn_like(x))
            (2 - 2 * F.cosine_similarity(p, z, dim=-1)).mean().backward()
            opt.step()
            with torch.no_grad():
                tp, op = list(target.parameters()), list(online.parameters())
                if update == "lerp":
                    torch._foreach_lerp_(tp, op, 0.01)
                else:
                    for a, b in zip(tp, op):
                        a.data = a.data * 0.99 + b.data * 0.01
    assert not w.findings("frozen_stats_updated")
