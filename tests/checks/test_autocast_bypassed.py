"""``autocast_bypassed``: layers that escape ``torch.autocast`` while their peers do not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from _regime import DIM, LossOf, hf_train, lightning_fit, problems
from torch import nn

import gradwatch
from gradwatch.checks.autocast_bypassed import AutocastBypassed

ID = AutocastBypassed.id


class BroadcastLinear(nn.Linear):
    """A "grouped" linear written as multiply-and-sum: no op autocast casts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-1) * self.weight.t()).sum(-2) + self.bias


class Net(nn.Module):
    def __init__(self, head: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(DIM, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = head if head is not None else nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.head(h)


def _run(model: nn.Module, steps: int = 4, autocast: bool = True) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt) as w:
        for _ in range(steps):
            x, y = torch.randn(16, DIM, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            nn.functional.mse_loss(out.float(), y).backward()
            opt.step()
    return w.report()


def test_a_hand_written_matmul_escapes_autocast() -> None:
    (f,) = _run(Net(head=BroadcastLinear(16, 1))).by_check(ID)
    assert f.severity == "warning" and f.module == "head" and f.first_step == 0
    assert f.details["modules"] == ["head"] and f.details["cause"] == "op"
    assert f.details["dtype"] == "float32" and f.details["autocast_dtype"] == "bfloat16"
    assert sorted(f.params) == ["head.bias", "head.weight"]


class ThreadedBranches(nn.Module):
    """Two branches run in a thread pool: autocast is thread-local, the worker has none."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = nn.Linear(DIM, 8)
        self.right = nn.Linear(DIM, 8)
        self.head = nn.Linear(16, 1)
        self.pool = ThreadPoolExecutor(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right = self.pool.submit(self.right, x)  # the worker thread: no autocast there
        left = self.left(x)
        return self.head(torch.cat([left, right.result().to(left.dtype)], 1))


def test_a_branch_run_in_another_thread() -> None:
    model = ThreadedBranches()
    (f,) = _run(model).by_check(ID)
    model.pool.shutdown()
    assert f.details["modules"] == ["right"] and f.details["cause"] == "thread"


class DoubleConv(nn.Module):
    """A conv stack whose second conv is computed by hand through unfold + multiply-sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv1d(2, 4, 3, padding=1)
        self.c2 = HandConv(4, 4, 3, padding=1)
        self.c3 = nn.Conv1d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x.view(-1, 2, 4)))))).mean(-1)


class HandConv(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = nn.functional.pad(x, (1, 1)).unfold(2, 3, 1)  # N, C, L, K
        return (cols.unsqueeze(1) * self.weight[None, :, :, None, :]).sum((2, 4)) + self.bias[
            None, :, None
        ]


def test_a_conv_computed_by_hand() -> None:
    (f,) = _run(DoubleConv()).by_check(ID)
    assert f.details["modules"] == ["c2"] and f.module == "c2"


class Fp32Head(nn.Module):
    """The head kept in float32 on purpose, as the autocast docs show."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.net.fc2(torch.relu(self.net.fc1(x))))
        with torch.autocast("cpu", enabled=False):
            return self.net.head(h.float())


class _Fp32Linear(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class CustomFwdLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp32Linear.apply(x, self.weight, self.bias)


@pytest.mark.parametrize(
    "make",
    [Net, Fp32Head, lambda: Net(head=CustomFwdLinear(16, 1))],
    ids=["all_autocast", "autocast_disabled_around_head", "custom_fwd_cast_inputs"],
)
def test_correct_look_alikes_are_silent(make: Any) -> None:
    assert problems(_run(make())) == []


def test_without_autocast_nothing_is_judged() -> None:
    assert not _run(Net(head=BroadcastLinear(16, 1)), autocast=False).by_check(ID)


class AutocastInside(nn.Module):
    """The Lightning/HF style: the framework's precision plugin wraps the step in autocast."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.net = Net(head=head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).float()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_bf16_mixed(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    report = lightning_fit(AutocastInside(BroadcastLinear(16, 1)), tmp_path, precision="bf16-mixed")
    (f,) = report.by_check(ID)
    assert f.details["modules"] == ["net.net.head"]
    clean = lightning_fit(AutocastInside(nn.Linear(16, 1)), tmp_path, precision="bf16-mixed")
    assert problems(clean) == []


@pytest.mark.slow
def test_hf_trainer_bf16(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = hf_train(LossOf(AutocastInside(BroadcastLinear(16, 1))), tmp_path, bf16=True)
    (f,) = report.by_check(ID)
    assert f.details["modules"] == ["net.net.head"]
    assert problems(hf_train(LossOf(AutocastInside(nn.Linear(16, 1))), tmp_path, bf16=True)) == []
