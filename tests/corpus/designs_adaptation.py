"""Canonical adaptation designs: second-order MAML, LoRA (by hand and with peft),
uncertainty-weighted multi-task learning, prototypical networks' episodes."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen
from _harness import Built, Program
from torch import nn
from torch.func import functional_call


def _sinusoid_tasks(n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Finn et al.'s sinusoid regression: each task an amplitude and phase, K=5 support/query."""
    g = gen(seed)
    out = []
    for _ in range(n):
        tasks = []
        for _t in range(2):  # a meta-batch of two tasks
            amp = 0.1 + 4.9 * torch.rand(1, generator=g)
            phase = math.pi * torch.rand(1, generator=g)
            x = 10 * torch.rand(10, 1, generator=g) - 5
            tasks.append(
                (x[:5], amp * torch.sin(x[:5] - phase), x[5:], amp * torch.sin(x[5:] - phase))
            )
        out.append(tuple(torch.stack(t) for t in zip(*tasks)))
    return out


def _maml_loss(model: nn.Module, batch: Any, inner_lr: float = 0.01) -> torch.Tensor:
    xs, ys, xq, yq = batch
    params = dict(model.named_parameters())
    losses = []
    for t in range(xs.size(0)):
        support = F.mse_loss(functional_call(model, params, (xs[t],)), ys[t])
        grads = torch.autograd.grad(support, list(params.values()), create_graph=True)
        fast = {n: p - inner_lr * g for (n, p), g in zip(params.items(), grads)}
        losses.append(F.mse_loss(functional_call(model, fast, (xq[t],)), yq[t]))
    return torch.stack(losses).mean()


def _maml() -> Built:
    model = nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _maml_loss(model, batch).backward()  # through the inner step: second order
        opt.step()

    return Built(model, opt, _sinusoid_tasks(4, 0), step, _maml_loss, probe_optimizer=opt)


class LoRALinear(nn.Module):
    """Hu et al. 2021 (microsoft/LoRA loralib): W x + (alpha / r) B A x, W frozen, B = 0 at start."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def _pretrained_mlp() -> nn.Sequential:
    """A "pretrained" MLP: trained first on a related task, as a checkpoint would be."""
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in classes(20, 64, 16, 4, seed=30):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _lora_by_hand() -> Built:
    model = _pretrained_mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    model[0], model[2] = LoRALinear(model[0]), LoRALinear(model[2])
    model[4].requires_grad_(True)  # a new task's head, trained in full
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()

    return Built(model, opt, classes(4, 16, 16, 4, seed=31), step, _ce, probe_optimizer=opt)


def _lora_peft() -> Built:
    from peft import LoraConfig, get_peft_model

    base = _pretrained_mlp()
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["0", "2"],
                        modules_to_save=["4"])  # fmt: skip
    model = get_peft_model(base, config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()

    return Built(model, opt, classes(4, 16, 16, 4, seed=32), step, _ce, probe_optimizer=opt)


class MultiTask(nn.Module):
    """Kendall et al. 2018: a shared trunk, two heads and a learnable log-variance per task."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls_head, self.reg_head = nn.Linear(32, 4), nn.Linear(32, 1)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls_head(h), self.reg_head(h).squeeze(1)


def _multitask_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, target = batch
    logits, pred = model(x)
    losses = torch.stack([F.cross_entropy(logits, y), F.mse_loss(pred, target)])
    s = model.log_vars  # each term exp(-s) L + s: the weights learn the task's noise
    return (torch.exp(-s) * losses + s).sum()


def _multitask() -> Built:
    model = MultiTask()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = gen(33)
    batches = [
        (x, y, 3 * x[:, 0] + torch.randn(16, generator=g)) for x, y in classes(4, 16, 16, 4, 33)
    ]

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _multitask_loss(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, _multitask_loss, probe_optimizer=opt)


N_WAY, N_SUPPORT, N_QUERY = 3, 3, 2


def _episodes(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    """One tensor per episode, laid out as jakesnell/prototypical-networks does: every
    class's support samples, then every class's queries (the loss splits it by position)."""
    g = gen(seed)
    centers = 2 * torch.randn(10, 16, generator=g)
    out = []
    for _ in range(n):
        ways = torch.randperm(10, generator=g)[:N_WAY]
        xs = [centers[c] + torch.randn(N_SUPPORT, 16, generator=g) for c in ways]
        xq = [centers[c] + torch.randn(N_QUERY, 16, generator=g) for c in ways]
        out.append((torch.cat([*xs, *xq]),))
    return out


def _proto_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    z = model(batch[0])
    support = z[: N_WAY * N_SUPPORT].view(N_WAY, N_SUPPORT, -1).mean(1)  # one prototype a class
    queries = z[N_WAY * N_SUPPORT :]
    target = torch.arange(N_WAY).repeat_interleave(N_QUERY)
    return F.cross_entropy(-(torch.cdist(queries, support) ** 2), target)


def _prototypical() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _proto_loss(model, batch).backward()
        opt.step()

    # The episode's layout is positional by design: a probe given this loss is told so
    # (batch_order_dependent's hint); the loss-free probes inside watch() need nothing.
    declared = {"checks": {"batch_order_dependent": {"compare_loss": False}}}
    return Built(model, opt, _episodes(6, 3), step, _proto_loss, config=declared)


PROGRAMS = [
    Program("maml_second_order", "maml", _maml,
            "Finn et al. 2017 MAML, sinusoid regression, second order (create_graph=True)"),
    Program("lora_by_hand", "lora", _lora_by_hand,
            "Hu et al. 2021 LoRA; microsoft/LoRA loralib Linear (B = 0, alpha / r)"),
    Program("lora_peft", "lora", _lora_peft, "huggingface/peft get_peft_model with LoraConfig"),
    Program("uncertainty_weighted_multitask", "multi-task", _multitask,
            "Kendall et al. 2018 multi-task weighting by learned homoscedastic uncertainty"),
    Program("prototypical_networks", "few-shot", _prototypical,
            "Snell et al. 2017; jakesnell/prototypical-networks (support then queries, split "
            "by position; compare_loss declared off)"),
]  # fmt: skip
