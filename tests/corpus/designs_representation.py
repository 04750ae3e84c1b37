"""Canonical representation-learning designs: SimCLR, CLIP, MoCo (InfoNCE), batch-hard triplets,
Siamese pairs, mean teacher, distillation, DANN."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen
from _harness import Built, Program
from torch import nn


def _encoder(d: int = 16, out: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, out))


def _views(n: int, bs: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two augmented views (noise, random feature dropout) of the same samples."""
    g = gen(seed)
    out = []
    for _ in range(n):
        x = torch.randn(bs, 16, generator=g)
        views = [
            (x + 0.1 * torch.randn(bs, 16, generator=g))
            * (torch.rand(bs, 16, generator=g) > 0.2).float()
            for _ in range(2)
        ]
        out.append((views[0], views[1]))
    return out


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    """SimCLR's NT-Xent: 2N views, each one's positive is its pair, the 2N-2 others negatives."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.size(0)
    sim = z @ z.t() / tau
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, targets)


class SimCLR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _encoder()
        self.projector = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))


def _simclr_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nt_xent(model(batch[0]), model(batch[1]))


def _simclr() -> Built:
    model = SimCLR()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _simclr_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, _views(4, 16, 0), step, _simclr_loss, probe_optimizer=opt)


class CLIP(nn.Module):
    """Radford et al. 2021 Figure 3: two encoders, a learned temperature, symmetric CE."""

    def __init__(self) -> None:
        super().__init__()
        self.image_encoder, self.text_encoder = _encoder(16, 8), nn.Embedding(12, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))  # log(1 / 0.07)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        i = F.normalize(self.image_encoder(images), dim=-1)
        t = F.normalize(self.text_encoder(texts).mean(1), dim=-1)
        return self.logit_scale.exp() * i @ t.t()


def _clip_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(*batch)
    labels = torch.arange(logits.size(0))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _clip() -> Built:
    model = CLIP()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.2)
    g = gen(1)
    proj = torch.randn(12, 16, generator=g)
    batches = []
    for _ in range(4):
        texts = torch.randint(0, 12, (16, 3), generator=g)
        images = proj[texts].sum(1) + 0.1 * torch.randn(16, 16, generator=g)
        batches.append((images, texts))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _clip_loss(model, batch).backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)  # open_clip clamps to log(100)

    return Built(model, opt, batches, step, _clip_loss, probe_optimizer=opt)


def _moco() -> Built:
    model = _encoder(16, 8)  # the query encoder; the key encoder is its momentum copy
    key_encoder = copy.deepcopy(model)
    for p in key_encoder.parameters():
        p.requires_grad = False
    queue = F.normalize(torch.randn(8, 32), dim=0)  # (dim, K) negatives
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    state = {"queue": queue, "ptr": 0}

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        im_q, im_k = batch  # facebookresearch/moco builder.py forward()
        q = F.normalize(model(im_q), dim=1)
        with torch.no_grad():
            for pq, pk in zip(model.parameters(), key_encoder.parameters()):
                pk.data = pk.data * 0.999 + pq.data * 0.001
            k = F.normalize(key_encoder(im_k), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ state["queue"].clone().detach()
        logits = torch.cat([l_pos, l_neg], 1) / 0.07
        loss = F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ptr = state["ptr"]  # dequeue and enqueue
        state["queue"][:, ptr : ptr + k.size(0)] = k.t()
        state["ptr"] = (ptr + k.size(0)) % 32

    return Built(model, opt, _views(4, 16, 2), step)


def batch_hard_triplet(emb: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    """Hermans et al. 2017: for each anchor, its farthest positive and nearest negative."""
    dist = torch.cdist(emb, emb)
    same = labels[:, None] == labels[None, :]
    hardest_pos = (dist * same.float()).max(1).values
    hardest_neg = dist.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


def _triplet() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = gen(3)
    centers = 2 * torch.randn(4, 16, generator=g)
    batches = []
    for _ in range(4):  # P=4 identities x K=4 samples, the paper's PK sampling
        y = torch.arange(4).repeat_interleave(4)
        batches.append((centers[y] + torch.randn(16, 16, generator=g), y))

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return batch_hard_triplet(model(batch[0]), batch[1], margin=0.3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, loss_fn, probe_optimizer=opt)


class SiameseNetwork(nn.Module):
    """pytorch/examples siamese_network: a shared tower, the pair's features concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.fc = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.tower(a), self.tower(b)], 1)).squeeze(1)


def _siamese_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    a, b, same = batch
    return F.binary_cross_entropy_with_logits(model(a, b), same)


def _siamese() -> Built:
    model = SiameseNetwork()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = gen(4)
    centers = 2 * torch.randn(3, 16, generator=g)
    batches = []
    for _ in range(4):
        ya, yb = torch.randint(0, 3, (16,), generator=g), torch.randint(0, 3, (16,), generator=g)
        a = centers[ya] + torch.randn(16, 16, generator=g)
        b = centers[yb] + torch.randn(16, 16, generator=g)
        batches.append((a, b, (ya == yb).float()))

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _siamese_loss(model, batch).backward()
        opt.step()
        sched.step()

    return Built(model, opt, batches, step, _siamese_loss, probe_optimizer=opt)


def _mean_teacher() -> Built:
    student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.detach_()  # CuriousAI/mean-teacher create_model(ema=True)
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    labeled = classes(4, 8, 16, 4, seed=5)
    g = gen(6)
    batches = [(x, y, torch.randn(24, 16, generator=g)) for x, y in labeled]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y, unlabeled = batch  # main.py train(): class loss + consistency, then EMA update
        inputs = torch.cat([x, unlabeled])
        noise = 0.1 * torch.randn_like(inputs)
        logits = model(inputs + noise)
        with torch.no_grad():
            ema_logits = teacher(inputs + 0.1 * torch.randn_like(inputs))
        class_loss = F.cross_entropy(logits[: x.size(0)], y)
        consistency = F.mse_loss(logits.softmax(1), ema_logits.softmax(1))
        loss = class_loss + 1.0 * consistency
        opt.zero_grad()
        loss.backward()
        opt.step()
        alpha = min(1 - 1 / (i + 2), 0.99)
        for ema_p, p in zip(teacher.parameters(), model.parameters()):
            ema_p.data.mul_(alpha).add_(p.data, alpha=1 - alpha)

    return Built(student, opt, batches, step)


def _distillation() -> Built:
    batches = classes(4, 16, 16, 4, seed=7)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    t_opt = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for x, y in classes(40, 64, 16, 4, seed=7):  # the teacher, trained first on the same task
        t_opt.zero_grad()
        F.cross_entropy(teacher(x), y).backward()
        t_opt.step()
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    t_temp, alpha = 4.0, 0.9

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch  # Hinton et al. 2015: soft targets at T, scaled by T^2, plus the hard CE
        logits = model(x)
        with torch.no_grad():
            soft = (teacher(x) / t_temp).softmax(1)
        kd = F.kl_div((logits / t_temp).log_softmax(1), soft, reduction="batchmean")
        return alpha * t_temp**2 * kd + (1 - alpha) * F.cross_entropy(logits, y)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    return Built(student, opt, batches, step, loss_fn, probe_optimizer=opt)


class GradReverse(torch.autograd.Function):
    """Ganin & Lempitsky 2015: identity forward, gradient times -lambda backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lambd: float) -> torch.Tensor:
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output.neg() * ctx.lambd, None


class DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.label_classifier = nn.Linear(16, 4)
        self.domain_classifier = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, lambd: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.label_classifier(f), self.domain_classifier(GradReverse.apply(f, lambd))


def _dann_loss(model: nn.Module, batch: Any, lambd: float = 0.5) -> torch.Tensor:
    xs, ys, xt = batch
    class_out, dom_s = model(xs, lambd)
    _, dom_t = model(xt, lambd)
    dom = torch.cat([dom_s, dom_t])
    dom_y = torch.cat([torch.zeros(len(xs)), torch.ones(len(xt))]).long()
    return F.cross_entropy(class_out, ys) + F.cross_entropy(dom, dom_y)


def _dann() -> Built:
    model = DANN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = gen(8)
    src = classes(4, 16, 16, 4, seed=9)
    batches = [(xs, ys, xs + 0.5 + 0.1 * torch.randn(16, 16, generator=g)) for xs, ys in src]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        p = i / len(batches)  # the paper's schedule: lambda = 2 / (1 + exp(-10 p)) - 1
        lambd = 2.0 / (1.0 + float(torch.exp(torch.tensor(-10.0 * p)))) - 1
        opt.zero_grad()
        _dann_loss(model, batch, lambd).backward()
        opt.step()

    return Built(model, opt, batches, step, _dann_loss, probe_optimizer=opt)


PROGRAMS = [
    Program("simclr_nt_xent", "contrastive", _simclr, "Chen et al. 2020 SimCLR (NT-Xent)"),
    Program("clip_symmetric_infonce", "contrastive", _clip,
            "Radford et al. 2021 CLIP Figure 3; mlfoundations/open_clip (logit scale clamp)"),
    Program("moco_queue_momentum_encoder", "contrastive", _moco,
            "He et al. 2020 MoCo; facebookresearch/moco builder.py (InfoNCE, queue, EMA keys)"),
    Program("batch_hard_triplet", "metric learning", _triplet,
            "Hermans et al. 2017 In Defense of the Triplet Loss (batch hard, PK sampling)"),
    Program("siamese_pairs", "metric learning", _siamese,
            "pytorch/examples siamese_network (Adadelta, StepLR, BCE on pairs)"),
    Program("mean_teacher", "mean teacher", _mean_teacher,
            "Tarvainen & Valpola 2017; CuriousAI/mean-teacher pytorch main.py"),
    Program("distillation_frozen_teacher", "distillation", _distillation,
            "Hinton et al. 2015 knowledge distillation (T^2-scaled KL + CE)"),
    Program("dann_gradient_reversal", "dann", _dann,
            "Ganin & Lempitsky 2015 DANN (GradReverse autograd.Function)"),
]  # fmt: skip
