"""``stale_param`` ``cause: precision``: bf16/fp16 weights whose updates round away."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _regime import DIM, LossOf, hf_train, lightning_fit, problems
from torch import nn

import gradwatch
from gradwatch.checks.stale import StaleParam

ID = StaleParam.id
WIDE = 64


def _mlp(dtype: torch.dtype = torch.float32, dim: int = WIDE) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1)).to(dtype)


def _loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    dtype: torch.dtype,
    autocast: Optional[torch.dtype] = None,
    steps: int = 5,
) -> gradwatch.Report:
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt) as w:
        for _ in range(steps):
            x = torch.randn(32, WIDE, generator=g).to(dtype)
            y = torch.randn(32, 1, generator=g)
            opt.zero_grad()
            with torch.autocast(
                "cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None
            ):
                out = model(x)
            nn.functional.mse_loss(out.float(), y).backward()
            opt.step()
    return w.report()


def _precision(report: gradwatch.Report) -> list[Any]:
    return [f for f in report.by_check(ID) if f.details.get("cause") == "precision"]


def _layers(found: list[Any]) -> set[str]:
    """The layers the findings name: one finding per param group and cause groups them."""
    return {name for f in found for name in (f.details.get("layers") or [f.module])}


def test_pure_bf16_weights_with_a_small_sgd_step() -> None:
    model = _mlp(torch.bfloat16)
    report = _loop(model, torch.optim.SGD(model.parameters(), lr=1e-4), dtype=torch.bfloat16)
    found = _precision(report)
    assert _layers(found) == {"0", "2"}
    (f,) = found  # one param group, one cause: one finding
    # the whole model does not train: an error whatever stale_param's default (warning)
    assert f.severity == "error" and f.first_step == 2  # the first steps are all observed
    assert f.details["dtype"] == "bfloat16" and f.details["moved_fraction"] < 0.1
    assert "round the updates away" in f.message


def test_bf16_fine_tuning_with_adam_at_a_tiny_learning_rate() -> None:
    model = _mlp(torch.bfloat16)
    report = _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-6), dtype=torch.bfloat16)
    assert _layers(_precision(report)) == {"0", "2"}


def test_half_weights_with_sgd() -> None:
    model = _mlp(torch.float16)
    report = _loop(model, torch.optim.SGD(model.parameters(), lr=1e-5), dtype=torch.float16)
    assert {f.details["dtype"] for f in _precision(report)} == {"float16"}


class KahanSGD(torch.optim.Optimizer):
    """SGD with Kahan-compensated bf16 updates (as optimi's ``kahan_sum=True`` keeps them)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                comp = self.state[p].setdefault("kahan_comp", torch.zeros_like(p))
                y = -group["lr"] * p.grad - comp
                t = p + y
                comp.copy_((t - p) - y)
                p.copy_(t)


def test_correct_look_alikes_are_silent() -> None:
    # fp32 master weights, bf16 compute: the usual mixed precision
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    assert problems(_loop(model, opt, dtype=torch.float32, autocast=torch.bfloat16)) == []
    # bf16 weights with Kahan summation: the lost low bits are carried to later steps
    model = _mlp(torch.bfloat16)
    report = _loop(model, KahanSGD(model.parameters(), lr=1e-4), dtype=torch.bfloat16)
    assert not _precision(report)
    # bf16 weights at a learning rate their resolution can hold
    model = _mlp(torch.bfloat16)
    report = _loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype=torch.bfloat16)
    assert problems(report) == []


def test_bf16_embedding_rows_outside_the_batch_are_not_rounding() -> None:
    """SGD leaves rows without a gradient unchanged: not a precision loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Flatten(), nn.Linear(64, 1)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(5):
            x = torch.randint(0, 1000, (8, 4), generator=g)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
    assert not _precision(w.report())


class Cast(nn.Module):
    """Feeds float32 data to a bf16 network (what a bf16-loaded model's embedding does)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(torch.bfloat16)).float()


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_bf16_true_precision(tmp_path: Path) -> None:
    """``Trainer(precision="bf16-true")`` converts the weights to bf16; SGD at lr 1e-4 on
    them rounds away."""
    pytest.importorskip("pytorch_lightning")
    net = Cast(_mlp(dim=DIM))
    report = lightning_fit(net, tmp_path, lr=1e-4, precision="bf16-true")
    assert _layers(_precision(report)) >= {"net.net.2"}


def test_hf_trainer_on_a_model_loaded_in_bf16(tmp_path: Path) -> None:
    """``from_pretrained(torch_dtype=torch.bfloat16)`` then Trainer: weights stay bf16."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    net = Cast(_mlp(torch.bfloat16, dim=DIM))
    report = hf_train(LossOf(net), tmp_path, learning_rate=1e-6, optim="adamw_torch")
    assert _precision(report)
    clean = hf_train(LossOf(_mlp(dim=DIM)), tmp_path, bf16=True, optim="adamw_torch")
    assert not _precision(clean)  # bf16=True: autocast over float32 weights
