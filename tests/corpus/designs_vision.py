"""Canonical vision designs: CNN classifiers, segmentation, data mixing, pruning, fine-tuning."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _designs import gen, images
from _harness import Built, Program
from torch import nn
from torch.nn.utils import prune


class BasicBlock(nn.Module):
    """He et al.'s basic residual block (conv-BN-ReLU-conv-BN + shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, k: int = 4, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.fc = nn.Linear(2 * width, k)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))
        return F.adaptive_avg_pool2d(out, 1).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _resnet_cosine() -> Built:
    model = ResNet()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()

    return Built(model, opt, images(4, 16, 4), step, _ce, probe_optimizer=opt)


class UNet(nn.Module):
    """Ronneberger et al.'s U-Net, two levels: double convs, max-pool down, transposed conv up."""

    @staticmethod
    def double(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )  # fmt: skip

    def __init__(self, k: int = 3, w: int = 8) -> None:
        super().__init__()
        self.inc, self.down = self.double(1, w), self.double(w, 2 * w)
        self.up = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.dec = self.double(2 * w, w)
        self.outc = nn.Conv2d(w, k, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down(F.max_pool2d(x1, 2))
        return self.outc(self.dec(torch.cat([x1, self.up(x2)], dim=1)))


def _seg_batches() -> list[tuple[torch.Tensor, ...]]:
    g = gen(3)
    out = []
    for _ in range(3):
        masks = torch.zeros(4, 16, 16, dtype=torch.long)
        for b in range(4):  # a square of class 1 and one of class 2 on a background of 0
            r, c = torch.randint(0, 8, (2,), generator=g).tolist()
            masks[b, r : r + 6, c : c + 6] = 1
            r, c = torch.randint(0, 12, (2,), generator=g).tolist()
            masks[b, r : r + 4, c : c + 4] = 2
        x = masks[:, None].float() + 0.3 * torch.randn(4, 1, 16, 16, generator=g)
        out.append((x, masks))
    return out


def _dice_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, masks = batch
    logits = model(x)
    probs = logits.softmax(1)
    onehot = F.one_hot(masks, 3).permute(0, 3, 1, 2).float()
    inter = (probs * onehot).sum((0, 2, 3))
    dice = 1 - (2 * inter + 1) / (probs.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1)
    return F.cross_entropy(logits, masks) + dice.mean()


def _unet() -> Built:
    model = UNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _dice_ce(model, batch).backward()
        opt.step()

    return Built(model, opt, _seg_batches(), step, _dice_ce, probe_optimizer=opt)


def _small_cnn(k: int = 4) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, k),
    )  # fmt: skip


def _mixup() -> Built:
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    rng = np.random.default_rng(0)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch  # facebookresearch/mixup-cifar10 train(): mixup_data, mixup_criterion
        lam = float(rng.beta(1.0, 1.0))
        index = torch.randperm(x.size(0))
        mixed = lam * x + (1 - lam) * x[index]
        out = model(mixed)
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[index])
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Built(model, opt, images(4, 16, 4, seed=4), step, _ce, probe_optimizer=opt)


def _cutmix() -> Built:
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    rng = np.random.default_rng(1)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch  # clovaai/CutMix-PyTorch train.py: rand_bbox, lam adjusted to the box area
        x = x.clone()
        lam = float(rng.beta(1.0, 1.0))
        index = torch.randperm(x.size(0))
        h, w = x.shape[2:]
        cut = np.sqrt(1.0 - lam)
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        y1, y2 = np.clip(cy - ch // 2, 0, h), np.clip(cy + ch // 2, 0, h)
        x1, x2 = np.clip(cx - cw // 2, 0, w), np.clip(cx + cw // 2, 0, w)
        x[:, :, y1:y2, x1:x2] = x[index, :, y1:y2, x1:x2]
        lam = 1 - ((x2 - x1) * (y2 - y1) / (h * w))
        out = model(x)
        loss = F.cross_entropy(out, y) * lam + F.cross_entropy(out, y[index]) * (1.0 - lam)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Built(model, opt, images(4, 16, 4, seed=5), step, _ce, probe_optimizer=opt)


def _label_smoothing_onecycle() -> Built:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sched.step()

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return crit(model(batch[0]), batch[1])

    return Built(model, opt, images(4, 16, 4, seed=6), step, loss_fn, probe_optimizer=opt)


def _focal(model: nn.Module, batch: Any) -> torch.Tensor:
    """Lin et al.'s sigmoid focal loss (torchvision.ops.sigmoid_focal_loss), alpha .25, gamma 2."""
    x, targets = batch
    logits = model(x)
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    alpha_t = 0.25 * targets + 0.75 * (1 - targets)
    return (alpha_t * ce * (1 - p_t) ** 2).sum() / targets.sum().clamp(min=1.0)


def _focal_dense() -> Built:
    model = _small_cnn(k=6)  # 6 anchors' objectness, most of them background
    with torch.no_grad():  # RetinaNet's prior: the classifier's bias starts at -log((1-pi)/pi)
        model[-1].bias.fill_(-float(np.log((1 - 0.01) / 0.01)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    batches = [(x, F.one_hot(y, 6).float()) for x, y in images(4, 16, 6, seed=7)]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _focal(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, _focal, probe_optimizer=opt)


class FineTune(nn.Module):
    """A backbone (in practice loaded from a checkpoint) with a new head."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.backbone, self.head = ResNet(), nn.Linear(16, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.features(x))


def _frozen_backbone() -> Built:
    model = FineTune(3)
    for p in model.backbone.parameters():
        p.requires_grad = False  # the PyTorch transfer-learning tutorial's fixed feature extractor
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01, momentum=0.9)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        model.backbone.eval()  # its BatchNorm statistics stay the pretrained ones
        x, y = batch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return Built(model, opt, images(4, 16, 3, seed=8), step, _ce, probe_optimizer=opt)


def _pruned() -> Built:
    model = _small_cnn()
    for layer in (model[0], model[3], model[7]):  # the PyTorch pruning tutorial's global form
        prune.l1_unstructured(layer, name="weight", amount=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return Built(model, opt, images(4, 16, 4, seed=9), step, _ce, probe_optimizer=opt)


PROGRAMS = [
    Program("resnet_bn_cosine", "cnn classifier", _resnet_cosine,
            "He et al. 2016 ResNet; kuangliu/pytorch-cifar main.py (SGD nesterov, cosine)"),
    Program("unet_segmentation", "segmentation", _unet,
            "Ronneberger et al. 2015 U-Net; milesial/Pytorch-UNet (CE + dice)"),
    Program("mixup", "data mixing", _mixup,
            "Zhang et al. 2018 mixup; facebookresearch/mixup-cifar10 train.py"),
    Program("cutmix", "data mixing", _cutmix,
            "Yun et al. 2019 CutMix; clovaai/CutMix-PyTorch train.py"),
    Program("label_smoothing_onecycle", "cnn classifier", _label_smoothing_onecycle,
            "Szegedy et al. 2016 label smoothing; Smith 2018 one-cycle (torch OneCycleLR)"),
    Program("focal_loss_dense", "detection head", _focal_dense,
            "Lin et al. 2017 RetinaNet focal loss; torchvision.ops.sigmoid_focal_loss"),
    Program("frozen_backbone_finetune", "fine-tuning", _frozen_backbone,
            "PyTorch transfer learning tutorial: ConvNet as fixed feature extractor"),
    Program("pruning_masks", "pruning", _pruned,
            "Han et al. 2015; PyTorch pruning tutorial (torch.nn.utils.prune.l1_unstructured)"),
]  # fmt: skip
