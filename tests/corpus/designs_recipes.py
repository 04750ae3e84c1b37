"""Training recipes that handle gradients by hand: temperature scaling (a tensor outside any
module), PCGrad, two backward passes with retain_graph, gradual unfreezing, VAT, OHEM,
co-teaching, token-weighted accumulation, plateau and warm-restart schedules."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen
from _harness import Built, Program
from torch import nn


def _mlp(h: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, 4))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _trained(seed: int) -> nn.Sequential:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in classes(20, 64, 16, 4, seed=seed):
        opt.zero_grad()
        _ce(model, (x, y)).backward()
        opt.step()
    return model


def _temperature_scaling() -> Built:
    model = _trained(80).eval()  # Guo et al. 2017 (gpleiss/temperature_scaling): weights fixed
    for p in model.parameters():
        p.requires_grad_(False)
    temperature = torch.ones(1, requires_grad=True)  # held outside any module, on purpose
    opt = torch.optim.Adam([temperature], lr=0.05)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        with torch.no_grad():
            logits = model(x)
        opt.zero_grad()
        F.cross_entropy(logits / temperature, y).backward()
        opt.step()

    return Built(model, opt, classes(4, 64, 16, 4, seed=81), step)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head_a, self.head_b = nn.Linear(32, 4), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head_a(h), self.head_b(h).squeeze(1)


def _two_task_batches(seed: int) -> list[tuple[torch.Tensor, ...]]:
    return [(x, y, x[:, 1] - x[:, 2]) for x, y in classes(4, 16, 16, 4, seed=seed)]


def _two_task_losses(model: nn.Module, batch: Any) -> list[torch.Tensor]:
    x, y, target = batch
    logits, pred = model(x)
    return [F.cross_entropy(logits, y), F.mse_loss(pred, target)]


def _pcgrad() -> Built:
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        # Yu et al. 2020 PCGrad: each task's gradient projected off the others it conflicts with
        grads = []
        for loss in _two_task_losses(model, batch):
            g = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            grads.append(torch.cat([(z if z is not None else torch.zeros_like(p)).flatten()
                                    for z, p in zip(g, params)]))  # fmt: skip
        projected = []
        for k, g in enumerate(grads):
            g = g.clone()
            for j, other in enumerate(grads):
                dot = g @ other
                if j != k and dot < 0:
                    g -= dot / other.norm() ** 2 * other
            projected.append(g)
        flat = torch.stack(projected).sum(0)
        opt.zero_grad()
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()

    return Built(model, opt, _two_task_batches(82), step)


def _retain_graph_two_backward() -> Built:
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        loss_a, loss_b = _two_task_losses(model, batch)
        opt.zero_grad()
        loss_a.backward(retain_graph=True)  # both tasks' gradients add up in .grad
        (0.5 * loss_b).backward()
        opt.step()

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        loss_a, loss_b = _two_task_losses(model, batch)
        return loss_a + 0.5 * loss_b

    return Built(model, opt, _two_task_batches(83), step, loss_fn, probe_optimizer=opt)


def _gradual_unfreezing() -> Built:
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    groups = [model[0], model[2], model[4]]  # Howard & Ruder 2018 ULMFiT: last layer first
    for layer in groups[:-1]:
        layer.requires_grad_(False)
    opt = torch.optim.Adam(
        [
            {"params": layer.parameters(), "lr": 1e-3 / 2.6 ** (2 - k)}
            for k, layer in enumerate(groups)
        ]
    )  # discriminative rates

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        if i in (2, 4):  # unfreeze one more layer group every two steps
            groups[-1 - i // 2].requires_grad_(True)
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()

    return Built(model, opt, classes(6, 16, 16, 4, seed=84), step)


def _vat() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xi, eps, alpha = 1e-6, 1.0, 1.0
    g = gen(85)
    batches = [(x, y, torch.randn(32, 16, generator=g)) for x, y in classes(4, 16, 16, 4, 85)]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y, u = batch  # Miyato et al. 2018 VAT, one power iteration (lyakaap/VAT-pytorch)
        with torch.no_grad():
            pred = F.softmax(model(u), dim=1)
        d = F.normalize(torch.rand(u.shape).sub(0.5), dim=1).requires_grad_(True)
        adv_distance = F.kl_div(F.log_softmax(model(u + xi * d), 1), pred, reduction="batchmean")
        (grad,) = torch.autograd.grad(adv_distance, d)
        r_adv = F.normalize(grad, dim=1) * eps
        lds = F.kl_div(F.log_softmax(model(u + r_adv), 1), pred, reduction="batchmean")
        loss = F.cross_entropy(model(x), y) + alpha * lds
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Built(model, opt, batches, step)


def _ohem() -> Built:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch  # Shrivastava et al. 2016 OHEM: back-propagate only the hardest samples
        losses = F.cross_entropy(model(x), y, reduction="none")
        return losses.topk(x.size(0) // 4).values.mean()

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    return Built(model, opt, classes(4, 32, 16, 4, seed=86), step, loss_fn, probe_optimizer=opt)


def _coteaching() -> Built:
    net1, net2 = _mlp(), _mlp()  # Han et al. 2018: each net trains on its peer's small-loss set
    opt1 = torch.optim.Adam(net1.parameters(), lr=1e-3)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-3)
    g = gen(87)
    batches = []
    for x, y in classes(4, 32, 16, 4, seed=87):
        noisy = torch.rand(32, generator=g) < 0.2  # 20% symmetric label noise
        batches.append((x, torch.where(noisy, torch.randint(0, 4, (32,), generator=g), y)))

    def step(models: Any, opts: Any, batch: Any, i: int) -> None:
        x, y = batch
        loss1 = F.cross_entropy(models["net1"](x), y, reduction="none")
        loss2 = F.cross_entropy(models["net2"](x), y, reduction="none")
        keep = int(0.8 * x.size(0))
        idx1, idx2 = loss1.argsort()[:keep], loss2.argsort()[:keep]
        opt1.zero_grad()
        loss1[idx2].mean().backward()
        opt1.step()
        opt2.zero_grad()
        loss2[idx1].mean().backward()
        opt2.step()

    return Built({"net1": net1, "net2": net2}, {"net1": opt1, "net2": opt2}, batches, step)


def _token_weighted_accumulation() -> Built:
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 20))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = gen(88)
    steps = []
    for _ in range(2):  # two optimizer steps of two micro-batches of unequal token counts
        micro = []
        for n in (3, 9):
            tokens = torch.randint(1, 20, (4, 10), generator=g)
            labels = tokens.roll(-1, 1)
            labels[:, n:] = -100
            micro.append((tokens, labels))
        steps.append(micro)
    batches = [
        (mb, sum(int((m[1] != -100).sum()) for m in micro)) for micro in steps for mb in micro
    ]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        (tokens, labels), total = batch  # HF Trainer's num_items_in_batch: a sum, divided once
        logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, 20), labels.view(-1), reduction="sum") / total
        loss.backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()

    return Built(model, opt, batches, step)


def _plateau_and_restarts() -> Built:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2)
    val = classes(1, 32, 16, 4, seed=89)[0]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()
        restarts.step()  # snapshot ensembles (Huang et al. 2017): a restart every 2 steps
        model.eval()
        with torch.no_grad():
            _ce(model, val)

    return Built(model, opt, classes(4, 16, 16, 4, seed=90), step, _ce, probe_optimizer=opt)


def _log_vars_outside() -> Built:
    model = TwoHeads()
    log_vars = torch.zeros(2, requires_grad=True)  # Kendall et al.'s weights, outside the model
    opt = torch.optim.Adam([*model.parameters(), log_vars], lr=1e-2)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        losses = torch.stack(_two_task_losses(model, batch))
        return (torch.exp(-log_vars) * losses + log_vars).sum()

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    return Built(model, opt, _two_task_batches(91), step)


PROGRAMS = [
    Program("temperature_scaling", "calibration", _temperature_scaling,
            "Guo et al. 2017; gpleiss/temperature_scaling (a temperature tensor outside the model)"),
    Program("multitask_log_vars_outside_module", "multi-task", _log_vars_outside,
            "Kendall et al. 2018 weighting with the log-variances as a bare tensor in the optimizer"),
    Program("pcgrad", "multi-task", _pcgrad,
            "Yu et al. 2020 PCGrad (per-task autograd.grad, projection, .grad set by hand)"),
    Program("retain_graph_two_backward", "multi-task", _retain_graph_two_backward,
            "two task losses, each backward into .grad (retain_graph=True), one step"),
    Program("gradual_unfreezing", "fine-tuning", _gradual_unfreezing,
            "Howard & Ruder 2018 ULMFiT gradual unfreezing with discriminative rates"),
    Program("virtual_adversarial_training", "adversarial training", _vat,
            "Miyato et al. 2018 VAT; lyakaap/VAT-pytorch (power iteration by autograd.grad)"),
    Program("ohem_topk_loss", "hard example mining", _ohem,
            "Shrivastava et al. 2016 OHEM (the hardest quarter of the batch)"),
    Program("coteaching_noisy_labels", "noisy labels", _coteaching,
            "Han et al. 2018 Co-teaching (two nets, peer's small-loss samples)"),
    Program("token_weighted_accumulation", "accumulation", _token_weighted_accumulation,
            "HF Trainer num_items_in_batch: summed token loss over the whole step's tokens"),
    Program("cosine_warm_restarts_with_eval", "schedules", _plateau_and_restarts,
            "Loshchilov & Hutter 2017 SGDR (CosineAnnealingWarmRestarts), eval each step"),
]  # fmt: skip
