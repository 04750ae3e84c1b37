"""Tiny models with a few parameters, as statistics courses and the PyTorch tutorials train them."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from _designs import gen, regression
from _harness import Built, Program
from torch import nn


class ExponentialRate(nn.Module):
    """One parameter: the log-rate of an exponential density, fitted by maximum likelihood."""

    def __init__(self) -> None:
        super().__init__()
        self.log_rate = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_rate - self.log_rate.exp() * x  # log p(x)


def _nll(model: nn.Module, x: Any) -> torch.Tensor:
    return -model(x).mean()


def _density_1param() -> Built:
    model = ExponentialRate()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = gen(40)
    batches = [torch.empty(64).exponential_(2.5, generator=g) for _ in range(6)]

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _nll(model, x).backward()
        opt.step()

    return Built(model, opt, batches, step, _nll, probe_optimizer=opt)


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _linear_regression() -> Built:
    model = nn.Linear(3, 1)  # the PyTorch "learning PyTorch with examples" fit, four parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        _mse(model, batch).backward()
        opt.step()

    return Built(model, opt, regression(6, 32, 3, seed=41), step, _mse, probe_optimizer=opt)


def _logistic_regression() -> Built:
    model = nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    g = gen(42)
    batches = []
    for _ in range(3):
        x = torch.randn(64, 2, generator=g)
        y = ((x @ torch.tensor([1.5, -2.0]) + 0.3 * torch.randn(64, generator=g)) > 0).float()
        batches.append((x, y))

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(batch[0]).squeeze(1), batch[1])

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model, batch)
            loss.backward()
            return loss

        opt.step(closure)

    return Built(model, opt, batches, step, loss_fn, probe_optimizer=opt)


class GaussianMixture1D(nn.Module):
    """Two components: logits, means and log-scales, six parameters in all."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(2))
        self.means = nn.Parameter(torch.tensor([-0.5, 0.5]))
        self.log_scales = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x[:, None] - self.means) / self.log_scales.exp()
        comp = -0.5 * z**2 - self.log_scales - 0.5 * math.log(2 * math.pi)
        return torch.logsumexp(comp + self.logits.log_softmax(0), dim=1)  # log p(x)


def _mixture() -> Built:
    model = GaussianMixture1D()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = gen(43)
    batches = []
    for _ in range(4):
        side = torch.rand(64, generator=g) < 0.3
        batches.append(torch.where(side, -2.0, 1.5) + 0.5 * torch.randn(64, generator=g))

    def step(model: nn.Module, opt: Any, x: Any, i: int) -> None:
        opt.zero_grad()
        _nll(model, x).backward()
        opt.step()

    return Built(model, opt, batches, step, _nll, probe_optimizer=opt)


def _poisson_regression() -> Built:
    model = nn.Linear(2, 1)  # a GLM with a log link: three parameters
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = gen(44)
    batches = []
    for _ in range(4):
        x = torch.randn(32, 2, generator=g)
        rate = (0.5 + x @ torch.tensor([0.8, -0.4])).exp()
        batches.append((x, torch.poisson(rate, generator=g)))

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.poisson_nll_loss(model(batch[0]).squeeze(1), batch[1], log_input=True)

    def step(model: nn.Module, opt: Any, batch: Any, i: int) -> None:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()

    return Built(model, opt, batches, step, loss_fn, probe_optimizer=opt)


PROGRAMS = [
    Program("density_one_parameter", "tiny model", _density_1param,
            "maximum likelihood for an exponential rate (one parameter), by SGD"),
    Program("linear_regression", "tiny model", _linear_regression,
            "PyTorch tutorial 'Learning PyTorch with Examples': nn.Linear fitted with MSE and SGD"),
    Program("logistic_regression_lbfgs", "tiny model", _logistic_regression,
            "logistic regression by L-BFGS with a closure (torch.optim.LBFGS docs)"),
    Program("gaussian_mixture_1d", "tiny model", _mixture,
            "a two-component Gaussian mixture fitted by gradient ascent on the log-likelihood"),
    Program("poisson_regression", "tiny model", _poisson_regression,
            "a Poisson GLM with a log link (nn.PoissonNLLLoss, log_input=True)"),
]  # fmt: skip
