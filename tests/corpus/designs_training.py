"""Canonical training mechanics: checkpointing, AMP, accumulation, clipping, param groups, SWA/EMA,
warmup schedules, several optimizers."""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from _designs import classes, gen
from _harness import Built, Program
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel


def _mlp(d: int = 16, h: int = 32, k: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, k))


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class CheckpointedMLP(nn.Module):
    """Blocks recomputed in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, d: int = 16, h: int = 32, k: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(h), nn.Linear(h, h), nn.GELU(), nn.Dropout(0.1))
            for _ in range(depth)
        )
        self.out = nn.Linear(h, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + cp.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def _checkpointing() -> Built:
    model = CheckpointedMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad(set_to_none=True)
        _ce(model, batch).backward()
        opt.step()

    return Built(model, opt, classes(4, 16, 16, 4), step, _ce, probe_optimizer=opt)


def _amp_bf16() -> Built:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _ce(model, batch)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()  # bf16 needs no loss scaling
        opt.step()

    return Built(model, opt, classes(4, 16, 16, 4, seed=1), step, loss_fn, probe_optimizer=opt)


def _amp_grad_scaler() -> Built:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return _ce(model, batch)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()  # the torch.amp examples: "Gradient clipping" with unscale_
        scaler.scale(loss_fn(model, batch)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)
        scaler.update()

    batches = classes(4, 16, 16, 4, seed=2)
    return Built(model, opt, batches, step, loss_fn, probe_optimizer=opt, scaler=scaler)


def _accumulation() -> Built:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    accum = 4

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        loss = _ce(model, batch) / accum  # equal micro-batches: the mean over the whole batch
        loss.backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()

    return Built(model, opt, classes(8, 4, 16, 4, seed=3), step, _ce, probe_optimizer=opt)


def _clipping() -> Built:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ce(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()

    return Built(model, opt, classes(4, 16, 16, 4, seed=4), step, _ce, probe_optimizer=opt)


class TinyEncoder(nn.Module):
    def __init__(self, d: int = 16, k: int = 4) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(d, 32), nn.LayerNorm(32), nn.Linear(32, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def _decay_groups() -> Built:
    model = TinyEncoder()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]  # minGPT configure_optimizers
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    warmup, total = 2, 8

    def lr_lambda(s: int) -> float:  # linear warmup, cosine decay (HF get_cosine_schedule...)
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        _ce(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return Built(model, opt, classes(4, 16, 16, 4, seed=5), step, _ce, probe_optimizer=opt)


def _swa() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    swa_model = AveragedModel(model)  # torch.optim.swa_utils docs' recipe
    swa_sched = SWALR(opt, swa_lr=0.02, anneal_epochs=1)
    swa_start = 1
    batches = classes(4, 16, 16, 4, seed=6)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        model.train()
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()
        if i >= swa_start:
            swa_model.update_parameters(model)
            swa_sched.step()
        if i == len(batches) - 1:
            torch.optim.swa_utils.update_bn([b[0] for b in batches], swa_model)
            swa_model.eval()
            with torch.no_grad():
                swa_model(batches[0][0])

    return Built(model, opt, batches, step, _ce, probe_optimizer=opt)


def _ema_copy() -> Built:
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    ema = copy.deepcopy(model).eval()  # timm ModelEmaV2: a frozen copy, updated after each step
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _ce(model, batch).backward()
        opt.step()
        with torch.no_grad():
            for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
                e.copy_(e * 0.999 + (1 - 0.999) * m if e.is_floating_point() else m)
        if i == 3:
            with torch.no_grad():
                ema(batch[0])  # validation of the EMA weights

    return Built(model, opt, classes(4, 16, 16, 4, seed=7), step, _ce, probe_optimizer=opt)


class SparseEmbedClassifier(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, k: int = 3) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, d, mode="mean", sparse=True)
        self.fc = nn.Linear(d, k)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(tokens))


def _sparse_two_optimizers() -> Built:
    model = SparseEmbedClassifier()
    # Sparse gradients need SparseAdam; the dense rest gets Adam (two optimizers, one loss).
    opt_sparse = torch.optim.SparseAdam(list(model.embed.parameters()), lr=1e-2)
    opt_dense = torch.optim.Adam(model.fc.parameters(), lr=1e-2)
    g = gen(8)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, 50, (16, 6), generator=g)
        batches.append((tokens, tokens[:, 0] % 3))

    def step(model: nn.Module, opts: Any, batch: Any, i: int) -> None:
        for o in opts:
            o.zero_grad()
        _ce(model, batch).backward()
        for o in opts:
            o.step()

    return Built(model, [opt_sparse, opt_dense], batches, step, _ce)


def _bs1_sgd() -> Built:
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = classes(64, 1, 4, 3, seed=9)  # online learning: one sample per step

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return Built(model, opt, batches, step, _ce, probe_optimizer=opt)


PROGRAMS = [
    Program("grad_checkpointing", "checkpointing", _checkpointing,
            "Chen et al. 2016; torch.utils.checkpoint docs (use_reentrant=False)"),
    Program("amp_bf16_cpu", "amp", _amp_bf16, "torch.amp docs: CPU autocast with bfloat16"),
    Program("amp_grad_scaler", "amp", _amp_grad_scaler,
            "Micikevicius et al. 2018; torch.amp examples: GradScaler with unscale_ and clipping"),
    Program("grad_accumulation", "accumulation", _accumulation,
            "HF/torch recipes: loss / accumulation_steps, step every k micro-batches"),
    Program("grad_clip_norm", "clipping", _clipping,
            "Pascanu et al. 2013; torch.nn.utils.clip_grad_norm_"),
    Program("decay_param_groups_warmup_cosine", "param groups", _decay_groups,
            "karpathy/minGPT configure_optimizers (no decay on biases/norms), warmup + cosine"),
    Program("swa", "weight averaging", _swa,
            "Izmailov et al. 2018 SWA; torch.optim.swa_utils docs (AveragedModel, SWALR, update_bn)"),
    Program("ema_copy", "weight averaging", _ema_copy,
            "timm ModelEmaV2: an EMA copy of the weights updated after each step"),
    Program("sparse_embeddings_two_optimizers", "multiple optimizers", _sparse_two_optimizers,
            "torch docs: SparseAdam for sparse embedding gradients, Adam for the dense rest"),
    Program("batch_size_1_sgd", "online sgd", _bs1_sgd, "Bottou 2010: plain SGD, one sample a step"),
]  # fmt: skip
