"""``dead_param`` and ``exploding_grad`` on plain SGD at batch size 1 (issue 50).

One sample per step: three zero-gradient steps in a row are three samples for which no
unit of a small ReLU layer fired, not a dead layer, and per-sample gradient norms spread
over orders of magnitude (a well-fit sample's is tiny, a noisy label's is not). Both rules
measure the samples behind each step (the ``samples`` evidence). Still caught at batch
size 1: a ReLU layer killed by a negative bias (dead for every sample after), and inputs
blown up a thousandfold mid-run (a real explosion).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch


def _found(report: Any, check: str) -> list[Any]:
    return [f for f in report.findings if f.check == check and f.severity != "info"]


def _classifier(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-16-2 MLP on two Gaussian classes with a few flipped labels."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 2, generator=g) * 5
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    y[torch.randint(0, 300, (6,), generator=g)] ^= 1  # label noise
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)), x, y


def _sgd_one_at_a_time(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(len(x)):
            opt.zero_grad()
            F.cross_entropy(model(x[k : k + 1]), y[k : k + 1]).backward()
            opt.step()
    return w.report()


def test_per_sample_gradient_spread_is_no_spike() -> None:
    """The output layer's norm reaches 2e5 x its running median, within 12 x the largest."""
    for seed in (0, 1):
        model, x, y = _classifier(seed)
        assert not _found(_sgd_one_at_a_time(model, x, y, lr=0.1), "exploding_grad")


def test_explosion_at_batch_size_one_still_fires() -> None:
    model, x, y = _classifier(0)
    x = x.clone()
    x[150:] *= 1000  # a unit change in the data pipeline, half-way
    found = _found(_sgd_one_at_a_time(model, x, y, lr=1e-4), "exploding_grad")
    assert found and found[0].severity == "warning"


def _xor_run(seed: int, kill: bool = False) -> Any:
    """XOR with two hidden ReLUs, one random sample per step (the textbook loop)."""
    torch.manual_seed(seed)
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([[0.0], [1.0], [1.0], [0.0]])
    order = torch.randint(0, 4, (200,), generator=torch.Generator().manual_seed(seed))
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    if kill:
        with torch.no_grad():
            model[0].bias.fill_(-5.0)  # no unit fires for any input: dead from the start
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for i in order.tolist():
            opt.zero_grad()
            F.mse_loss(model(x[i : i + 1]), y[i : i + 1]).backward()
            opt.step()
    return w.report()


def test_a_few_samples_no_unit_fires_for_are_no_dead_layer() -> None:
    """Layer 0's gradient is zero for runs of up to 11 samples in a row, then it learns."""
    assert not _found(_xor_run(2), "dead_param")


def test_relu_layer_dead_for_every_sample_still_fires() -> None:
    (f,) = _found(_xor_run(2, kill=True), "dead_param")
    assert f.module == "0"
