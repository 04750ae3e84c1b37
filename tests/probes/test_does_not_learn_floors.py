"""``does_not_learn`` on objectives whose floor is not 0: a universal adversarial perturbation
bounded by an eps budget (negative from the start) and a Gaussian fitted by likelihood (its
floor is the data's entropy). They are judged by convergence, not by halving; a loss that
does not fall, or rises, is still a finding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "does_not_learn"
CFG = only(CHECK)
CFG["checks"][CHECK]["budget_s"] = 30.0  # room on a loaded machine: a run stops at its verdict


class UniversalPerturbation(nn.Module):
    """One perturbation for every input, within an L-inf ball of radius ``eps``, against a
    trained classifier held fixed (Moosavi-Dezfooli et al., 2017; the PGD-style recipe)."""

    def __init__(self, eps: float = 0.1, freeze: bool = True, bound: str = "clamp") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.clf = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
        if freeze:
            self.clf.requires_grad_(False)
        self.delta = nn.Parameter(torch.zeros(8))
        self.eps, self.bound = eps, bound

    def forward(self, x: Tensor) -> Tensor:
        if self.bound == "tanh":
            return self.clf(x + self.eps * torch.tanh(self.delta))
        return self.clf(x + self.delta.clamp(-self.eps, self.eps))


def fooling_loss(m: Any, b: Any) -> Tensor:
    """The attack maximises the classifier's loss: minimise its negation."""
    return -F.cross_entropy(m(b[0]), b[1])


def images() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


class Gaussian(nn.Module):
    """A one-dimensional density: a mean and a log standard deviation, fitted by NLL."""

    def __init__(self) -> None:
        super().__init__()
        self.mu, self.log_std = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.distributions.Normal(self.mu, self.log_std.exp()).log_prob(x)


def nll(m: Any, b: Tensor) -> Tensor:
    return -m(b).mean()


def samples(mean: float = 0.0, std: float = 1.0) -> Tensor:
    return mean + std * torch.randn(64, 1, generator=torch.Generator().manual_seed(0))


def _probe(model: nn.Module, batch: Any, loss_fn: Any, opt: Any) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, opt, config=CFG)


UAPS = {
    "clamp_frozen": dict(),
    "clamp_only_delta_in_the_optimizer": dict(freeze=False),
    "tanh_frozen": dict(bound="tanh"),
}


@pytest.mark.parametrize("name", sorted(UAPS))
def test_a_bounded_universal_perturbation_is_judged_by_convergence(name: str) -> None:
    model = UniversalPerturbation(**UAPS[name])
    report = _probe(model, images(), fooling_loss, torch.optim.Adam([model.delta], lr=1e-2))
    assert not findings(report, CHECK), findings(report, CHECK)[0].message
    (record,) = report.probes
    assert record.verdict == "passed", record.note
    assert record.details["judged_by"] == "convergence"
    assert "starts below 0" in record.details["no_zero_floor"]


@pytest.mark.parametrize("data", [samples(), samples(3.0, 2.0)], ids=["standard", "shifted"])
def test_a_gaussian_fitted_by_likelihood_passes(data: Tensor) -> None:
    model = Gaussian()
    report = _probe(model, data, nll, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert not findings(report, CHECK), findings(report, CHECK)[0].message
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].note


def test_a_density_at_its_entropy_says_how_it_was_judged() -> None:
    model = Gaussian()
    (record,) = _probe(model, samples(), nll, torch.optim.Adam(model.parameters(), lr=1e-2)).probes
    assert record.details["judged_by"] == "convergence"
    assert "one sample" in record.details["no_zero_floor"] and "convergence" in record.note


# -- the bugs, with the same objectives --------------------------------------------------------


def test_a_perturbation_with_a_learning_rate_of_zero_is_still_a_finding() -> None:
    model = UniversalPerturbation()
    report = _probe(model, images(), fooling_loss, torch.optim.Adam([model.delta], lr=0.0))
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and found.details["floor"] >= found.details["start"]


def test_a_perturbation_that_ascends_its_objective_is_still_a_finding() -> None:
    """``maximize=True`` on a loss already negated: the attack helps the classifier."""
    model = UniversalPerturbation(eps=0.5)
    opt = torch.optim.Adam([model.delta], lr=1e-2, maximize=True)
    (found,) = findings(_probe(model, images(), fooling_loss, opt), CHECK)
    assert found.severity == "error"


def test_a_density_whose_parameters_the_optimizer_does_not_move_is_still_a_finding() -> None:
    model = Gaussian()
    report = _probe(model, samples(3.0, 2.0), nll, torch.optim.SGD(model.parameters(), lr=0.0))
    (found,) = findings(report, CHECK)
    assert found.severity == "error"
