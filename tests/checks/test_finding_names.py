"""SPEC 8.1: every finding names its parameters, so ``ignore`` by parameter, SARIF locations
and baselines hold the findings whose evidence is a module, a param group or a node of the
loss's graph (the fourth round's: ``shared_module``, ``optimizer_hparams_degenerate``,
``clip_without_effect``, the loss-graph rules).

The contract itself runs over every check's own tests (``tests/_helpers/_named.py``, an
autouse fixture here and in ``tests/probes``); these tests pin which parameters are named.
"""

from __future__ import annotations

from typing import Any

import torch
from _built import DIM, fit, of
from _named import MODULE_LESS, NO_PARAMS, broken
from torch import nn
from torch.nn.utils import clip_grad_norm_

from gradwatch.checks import ALL_CHECKS
from gradwatch.checks.clip_without_effect import ClipWithoutEffect
from gradwatch.checks.loss_normalised import LossInputAlreadyNormalised
from gradwatch.checks.normalised_over_batch import NormalisedOverBatch
from gradwatch.checks.optimizer_hparams import OptimizerHparamsDegenerate
from gradwatch.checks.registry import SELF_CHECKS
from gradwatch.checks.shared_module import SharedModule
from gradwatch.render.sarif import sarif_log
from gradwatch.results import Finding


class Stack(nn.Module):
    """``[Block] * 3``: one block registered at three places (``shared_module``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16)] * 3)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def _shared(config: dict[str, Any] | None = None) -> list[Any]:
    model = Stack()
    return of(
        fit(model, torch.optim.SGD(model.parameters(), lr=0.01), config=config), "shared_module"
    )


def test_a_shared_module_names_its_parameters_under_every_place() -> None:
    (f,) = _shared()
    assert f.module == "layers"
    assert sorted(f.params) == sorted(
        f"layers.{k}.{p}" for k in range(3) for p in ("weight", "bias")
    )


def test_ignore_of_the_parameters_silences_a_shared_module_finding() -> None:
    assert _shared({"ignore": ["layers.*"]}) == []
    # one place ignored: the others still name the finding
    (f,) = _shared({"ignore": ["layers.0.*"]})
    assert sorted(f.params) == sorted(f"layers.{k}.{p}" for k in (1, 2) for p in ("weight", "bias"))


def test_sarif_and_baselines_hold_a_shared_module_finding() -> None:
    model = Stack()
    report = fit(model, torch.optim.SGD(model.parameters(), lr=0.01))
    (result,) = [
        r for r in sarif_log(report)["runs"][0]["results"] if r["ruleId"] == SharedModule.id
    ]
    assert "layers.0.weight" in result["properties"]["params"]
    model = Stack()
    again = fit(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert [f.check for f in again.with_baseline(report).findings if not f.baselined()] == []


def test_a_degenerate_param_group_names_the_groups_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt = torch.optim.Adam(groups, lr=1e-3, betas=(0.999, 0.9))  # swapped: both groups
    found = of(fit(model, opt), OptimizerHparamsDegenerate.id)
    assert [(f.details["group"], f.params) for f in found] == [
        (0, ["0.weight", "0.bias"]),
        (1, ["2.weight", "2.bias"]),
    ]
    silenced = of(fit(model, opt, config={"ignore": ["2.*"]}), OptimizerHparamsDegenerate.id)
    assert [f.details["group"] for f in silenced] == [0]


def test_a_clip_without_effect_names_the_optimizers_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))
    params = filter(lambda p: p.requires_grad, model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)  # reads the filter: the clip sees nothing
    (f,) = of(fit(model, opt, between=lambda: clip_grad_norm_(params, 1.0)), ClipWithoutEffect.id)
    assert f.params == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert f.details["params_are"] == "optimizer[0]'s parameters"


class TwoHeads(nn.Module):
    """A softmax classifier head into cross_entropy, and a regression head beside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(DIM, 16)
        self.cls = nn.Sequential(nn.Linear(16, 3), nn.Softmax(dim=-1))
        self.reg = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.cls(h), self.reg(h)


def _two_heads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    probs, value = model(x)
    return nn.functional.cross_entropy(probs, y[:, 0].long().clamp(0, 2)) + value.mean() * 0


def test_a_loss_graph_finding_names_the_parameters_upstream_of_its_node() -> None:
    model = TwoHeads()
    report = fit(model, torch.optim.SGD(model.parameters(), lr=0.01), loss=_two_heads)
    (f,) = of(report, LossInputAlreadyNormalised.id)
    # upstream of the softmax: the classifier head and the body, not the regression head
    assert sorted(f.params) == ["body.bias", "body.weight", "cls.0.bias", "cls.0.weight"]


class BatchSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(DIM, 16)
        self.pool = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.pool(torch.relu(self.enc(x))), dim=0)  # over the batch


def test_a_forward_op_finding_names_its_modules_parameters_and_those_upstream() -> None:
    model = BatchSoftmax()
    report = fit(model, torch.optim.SGD(model.parameters(), lr=0.01))
    (f,) = of(report, NormalisedOverBatch.id)
    assert sorted(f.params) == ["enc.bias", "enc.weight", "pool.bias", "pool.weight"]


def test_the_exceptions_are_registered_checks_with_reasons() -> None:
    ids = {c.id for c in [*ALL_CHECKS, *SELF_CHECKS]}
    assert set(NO_PARAMS) <= ids and set(MODULE_LESS) <= ids
    assert all(reason.strip() for _, reason in NO_PARAMS.values())
    assert all(reason.strip() for reason in MODULE_LESS.values())


def test_the_contract_fails_a_finding_without_parameters() -> None:
    """The fixture's judgement is not vacuous: a loss-graph finding without its parameters
    (as before SPEC 8.1) breaks it; a run-level one on the list does not."""
    f = Finding(check="shared_module", severity="warning", message="m")
    assert [p.split(":")[0] for p in broken(f)] == [
        "shared_module names no parameter",
        "shared_module names no module",
    ]
    f.check = "not_observed"
    assert broken(f) == []
