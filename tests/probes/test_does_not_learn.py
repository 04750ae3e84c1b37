"""``does_not_learn``: three real forms of a model that cannot overfit one batch, and look-alikes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "does_not_learn"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any, opt: Any) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, opt, config=CFG)


class SoftmaxHead(nn.Module):
    """Returns probabilities, and cross_entropy applies its own log-softmax on top."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(self.body(x), dim=-1)


def constant_init() -> nn.Module:
    """Every layer initialised to zero: the hidden units are identical and stay so."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
    return model


class SquashedRegression(nn.Module):
    """A sigmoid output for targets in [2, 5]: the loss has a floor far above zero."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.body(x))


def _regression() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=gen), 2 + 3 * torch.rand(16, 1, generator=gen)


def mse(m: Any, b: Any) -> Tensor:
    return F.mse_loss(m(b[0]), b[1])


@pytest.mark.parametrize(
    "make, batch, loss_fn",
    [(SoftmaxHead, data, ce), (constant_init, data, ce), (SquashedRegression, _regression, mse)],
)
def test_a_model_that_cannot_overfit_one_batch_is_found(
    make: Any, batch: Any, loss_fn: Any
) -> None:
    torch.manual_seed(0)
    model = make()
    report = _probe(model, batch(), loss_fn, torch.optim.Adam(model.parameters(), lr=1e-3))
    (finding,) = findings(report, CHECK)
    assert finding.severity == "error" and report.failed
    d = finding.details
    assert d["floor"] > d["target"] and d["start"] == d["curve"][0]
    assert verdicts(report) == {CHECK: "finding"}


def test_identical_units_name_the_layers_that_did_not_move() -> None:
    model = constant_init()
    report = _probe(model, data(), ce, torch.optim.Adam(model.parameters(), lr=1e-3))
    assert findings(report, CHECK)[0].details["layers_that_did_not_move"] == ["0", "2"]


def test_the_users_weights_and_optimizer_state_are_untouched() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _probe(model, data(), ce, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def _scheduled() -> tuple[nn.Module, Any]:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 100))  # warm-up from 0
    return model, opt


def _bn() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _dropout() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _slow_sgd() -> tuple[nn.Module, Any]:
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("make", [_scheduled, _bn, _dropout, _slow_sgd])
def test_models_that_learn_are_never_a_finding(make: Any) -> None:
    model, opt = make()
    report = _probe(model, data(), ce, opt)
    assert not findings(report, CHECK), findings(report, CHECK)[0].message
    assert verdicts(report)[CHECK] in {"passed", "not_observed"}


def test_a_warm_up_starts_from_the_schedulers_initial_rate() -> None:
    model, opt = _scheduled()
    (record,) = _probe(model, data(), ce, opt).probes
    assert record.verdict == "passed" and record.details["optimizer"] == "AdamW(lr=0.01)"


def test_a_loss_that_does_not_require_grad_is_not_judged() -> None:
    report = _probe(mlp(), data(), lambda m, b: ce(m, b).detach(), None)
    assert verdicts(report) == {CHECK: "not_observed"}
    assert report.findings[0].details["reason"] == "probe_not_differentiable"


class TwoLinear(nn.Module):
    """A correct linear regression (two summed heads, one unused): 5 degrees of freedom."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.unused = nn.Linear(4, 1), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) + self.head(x)


def test_a_model_too_small_to_memorise_the_batch_is_no_verdict() -> None:
    """8 random targets are beyond a linear model: it fits 2 (its capacity, not a bug)."""
    seen: dict[str, int] = {}
    for seed in range(12):
        torch.manual_seed(seed)
        model = TwoLinear()
        batch = (torch.randn(8, 4), torch.randn(8, 1))
        report = _probe(model, batch, mse, torch.optim.Adam(model.parameters(), lr=1e-3))
        assert not findings(report, CHECK), (seed, findings(report, CHECK)[0].message)
        verdict = verdicts(report)[CHECK]
        seen[verdict] = seen.get(verdict, 0) + 1
        if verdict == "not_observed":
            (blind,) = report.by_check("not_observed")
            assert blind.details["reason"] == "probe_capacity", blind.details
    assert seen.get("not_observed", 0) >= 2, seen  # some batches do lie beyond its capacity


def test_a_squashed_output_fits_two_samples_no_better() -> None:
    """The retry on two samples keeps a real floor a finding (a sigmoid before targets in [2, 5])."""
    torch.manual_seed(0)
    model = SquashedRegression()
    x, y = _regression()
    report = _probe(model, (x[:8], y[:8]), mse, torch.optim.Adam(model.parameters(), lr=1e-3))
    assert verdicts(report) == {CHECK: "finding"}


def test_a_budget_that_allows_a_few_steps_judges_nothing() -> None:
    """A loaded machine gave a correct Hugging Face model 6 AdamW steps at 1e-3: its loss
    had not fallen yet, which is no evidence that it cannot."""
    torch.manual_seed(0)
    model = mlp()

    def slow_ce(m: nn.Module, b: Any) -> Tensor:
        time.sleep(0.02)  # each step costs what a larger model's does
        return ce(m, b)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = {"checks": {**CFG["checks"], CHECK: {"budget_s": 0.15}}}
    report = gradwatch.probe(model, data(), slow_ce, opt, config=config)
    assert verdicts(report) == {CHECK: "not_observed"}, [f.message for f in report.findings]
    (blind,) = report.by_check("not_observed")
    assert blind.details["reason"] == "probe_budget" and "raise budget_s" in blind.message
