"""Correct programs that train through torch's less common mechanics: a closure optimizer,
a parametrization, attention's learned bias key and value, packed sequences,
one task per batch, a layer shared across depth, a multiplier trained by ascent, a rare
positive class, causal convolutions, a predicted variance and per-sample gradients with
``torch.func``. Written outside the corpus
first (the ninth session of issue 49), where every one of them trained without a finding."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _designs import classes, gen, regression, token_classes
from _harness import Built, Program
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.parametrizations import orthogonal
from torch.nn.utils.rnn import pack_padded_sequence


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _plain_step(loss: Any) -> Any:
    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()

    return step


def _lbfgs() -> Built:
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        def closure() -> torch.Tensor:  # several backward passes a step, each after zero_grad
            opt.zero_grad()
            loss = _ce(model, batch)
            loss.backward()
            return loss

        opt.step(closure)

    return Built(model, opt, classes(6, 16, 16, 4, seed=70), step, _ce)


def _token_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[2])


def _orthogonal() -> Built:
    model = nn.Sequential(orthogonal(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Built(model, opt, classes(6, 16, 16, 4, seed=72), _plain_step(_ce), _ce)


class BiasKvAttention(nn.Module):
    """Self-attention with learned bias key and value rows and a key padding mask, pooled
    over the tokens that are not padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.att = nn.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, pad = self.emb(tokens), tokens == 0
        a, _ = self.att(h, h, h, key_padding_mask=pad, need_weights=False)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((a * keep).sum(1) / keep.sum(1).clamp(min=1))


def _bias_kv_attention() -> Built:
    model = BiasKvAttention()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = token_classes(6, 8, 10, 50, 3, seed=73)
    return Built(model, opt, batches, _plain_step(_token_ce), _token_ce)


class PackedLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.rnn = nn.LSTM(16, 24, batch_first=True)
        self.head = nn.Linear(24, 3)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(
            self.emb(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def _packed_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0], batch[1]), batch[2])


def _packed_lstm() -> Built:
    model = PackedLstm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _packed_ce(model, batch).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

    return Built(model, opt, token_classes(6, 8, 10, 50, 3, seed=74), step, _packed_ce)


class TaskHeads(nn.Module):
    """MT-DNN's layout: a shared body and one head per task; each batch belongs to one task."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.heads = nn.ModuleDict({"a": nn.Linear(32, 3), "b": nn.Linear(32, 2)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.body(x))


def _task_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, task = batch
    return F.cross_entropy(model(x, task), y)


def _task_per_batch() -> Built:
    g = gen(75)
    batches = []
    for _ in range(12):  # a task drawn at random for each batch
        task = "ab"[int(torch.randint(0, 2, (1,), generator=g))]
        x = torch.randn(16, 16, generator=g)
        batches.append((x, torch.randint(0, 3 if task == "a" else 2, (16,), generator=g), task))
    model = TaskHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Built(model, opt, batches, _plain_step(_task_ce), _task_ce)


class SharedDepth(nn.Module):
    """ALBERT's cross-layer sharing: one encoder layer applied four times."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for _ in range(4):
            h = self.layer(h)
        return self.head(h.mean(1))


def _shared_layer() -> Built:
    model = SharedDepth()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = token_classes(6, 8, 10, 50, 3, seed=76)
    return Built(model, opt, batches, _plain_step(_token_ce), _token_ce)


class Constrained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lam = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _lagrangian_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(batch[0])
    constraint = out.pow(2).mean() - 4.0  # logits kept small on average
    return F.cross_entropy(out, batch[1]) + F.softplus(model.lam) * constraint


def _lagrangian() -> Built:
    model = Constrained()
    opts = [
        torch.optim.Adam(model.net.parameters(), lr=3e-3),
        torch.optim.SGD([model.lam], lr=0.05, maximize=True),  # the multiplier ascends
    ]

    def step(model: nn.Module, opts: Any, batch: Any, i: int) -> None:
        for o in opts:
            o.zero_grad()
        _lagrangian_loss(model, batch).backward()
        for o in opts:
            o.step()

    return Built(model, opts, classes(6, 16, 16, 4, seed=77), step, _lagrangian_loss)


def _bce(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = model(batch[0]).squeeze(1)
    return F.binary_cross_entropy_with_logits(logits, batch[1], pos_weight=torch.tensor(10.0))


def _rare_positives() -> Built:
    g = gen(78)
    batches = []
    for _ in range(8):  # 3 % positives: most batches hold negatives only
        y = (torch.rand(16, generator=g) < 0.03).float()
        batches.append((torch.randn(16, 16, generator=g) + y[:, None], y))
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    return Built(model, opt, batches, _plain_step(_bce), _bce)


class CausalConv(nn.Module):
    """WaveNet's dilated causal convolutions: left padding only, next value predicted."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(1, 8, 2, dilation=1)
        self.c2 = nn.Conv1d(8, 8, 2, dilation=2)
        self.out = nn.Conv1d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(F.pad(x, (1, 0))))
        return self.out(torch.relu(self.c2(F.pad(h, (2, 0)))))


def _next_value(model: nn.Module, batch: Any) -> torch.Tensor:
    series = batch[0]
    return F.mse_loss(model(series[..., :-1]), series[..., 1:])


def _causal_conv() -> Built:
    g = gen(79)
    t = torch.linspace(0, 6, 33)
    batches = [(torch.sin(t + 6 * torch.rand(8, 1, 1, generator=g)),) for _ in range(6)]
    model = CausalConv()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Built(model, opt, batches, _plain_step(_next_value), _next_value)


class MeanVariance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.mean, self.var = nn.Linear(32, 1), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mean(h), F.softplus(self.var(h)) + 1e-3


def _gaussian_nll(model: nn.Module, batch: Any) -> torch.Tensor:
    mean, var = model(batch[0])
    return F.gaussian_nll_loss(mean, batch[1], var)


def _heteroscedastic() -> Built:
    model = MeanVariance()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = regression(6, 16, 8, seed=80)
    return Built(model, opt, batches, _plain_step(_gaussian_nll), _gaussian_nll)


def _per_sample_dp() -> Built:
    """DP-SGD by hand, as torch.func's per-sample-gradients tutorial: ``vmap(grad(...))``
    runs the model once per sample (gradwatch's forward hooks see batched tensors there);
    each sample's gradient is clipped, the sum noised and written to ``.grad``."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        x, y = batch
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
        scale = (1.0 / (norms + 1e-6)).clamp(max=1.0)  # each sample's gradient at most 1
        for name, p in model.named_parameters():
            g = torch.einsum("n,n...->...", scale, per_sample[name])
            p.grad = (g + 0.5 * torch.randn_like(g)) / x.shape[0]
        opt.step()
        opt.zero_grad()

    return Built(model, opt, classes(6, 16, 16, 4, seed=81), step, _ce)


PROGRAMS = [
    Program("lbfgs_closure", "closure optimizer", _lbfgs,
            "torch.optim.LBFGS docs: opt.step(closure), zero_grad and backward in the closure"),
    Program("orthogonal_parametrization", "parametrization", _orthogonal,
            "torch.nn.utils.parametrizations.orthogonal (Lezcano-Casado 2019)"),
    Program("attention_bias_kv_padding", "padded text classifier", _bias_kv_attention,
            "nn.MultiheadAttention(add_bias_kv=True) with key_padding_mask, masked mean pool"),
    Program("packed_lstm_classifier", "padded text classifier", _packed_lstm,
            "pack_padded_sequence(enforce_sorted=False), clip_grad_norm_, StepLR per step"),
    Program("task_per_batch_heads", "multi-task", _task_per_batch,
            "Liu et al. 2019 MT-DNN: one task per mini-batch, a head per task"),
    Program("shared_layer_depth", "parameter sharing", _shared_layer,
            "Lan et al. 2020 ALBERT cross-layer parameter sharing"),
    Program("lagrange_multiplier_ascent", "constrained optimization", _lagrangian,
            "a Lagrangian: the multiplier trained by SGD(maximize=True), the model by descent"),
    Program("rare_positive_class", "imbalanced classification", _rare_positives,
            "BCEWithLogits with pos_weight; most batches hold no positive at all"),
    Program("causal_dilated_conv", "causal convolution", _causal_conv,
            "van den Oord et al. 2016 WaveNet dilated causal convolutions (left padding)"),
    Program("heteroscedastic_regression", "regression", _heteroscedastic,
            "Nix & Weigend 1994; F.gaussian_nll_loss with a predicted variance (softplus)"),
    Program("per_sample_dp_torch_func", "differential privacy", _per_sample_dp,
            "Abadi et al. 2016 DP-SGD by hand; torch.func per-sample-gradients tutorial "
            "(vmap(grad(functional_call)))"),
]  # fmt: skip
