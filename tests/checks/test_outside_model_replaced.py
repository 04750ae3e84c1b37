"""``param_outside_model`` says a layer was replaced, not "watch the whole model", when it was.

The whole model is watched; a layer of it was replaced after the optimizer was built, so the
optimizer holds the old tensors (same shapes as the new ones, which are in no optimizer).
Three forms: a fine-tune's classification head swapped before ``watch()``, a head swapped
between ``w = watch(...)`` and ``with w:``, and a weight re-created as a new Parameter. The
look-alike, a submodule watched while the optimizer holds the whole model, keeps the
"watch the whole model" hint.
"""

from __future__ import annotations

from typing import Callable

import torch
from _loops import batches
from torch import nn

import gradwatch
from gradwatch.checks.outside_model import ParamOutsideModel

ID = ParamOutsideModel.id


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.fc = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.backbone(x)))


def _loop(watched: nn.Module, model: nn.Module, opt: torch.optim.Optimizer,
          between: Callable[[], None] | None = None) -> gradwatch.Report:  # fmt: skip
    w = gradwatch.watch(watched, opt, config={"every_n_steps": 1, "warn": False})
    if between is not None:
        between()
    with w:
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


def _said_replaced(report: gradwatch.Report, layer: str) -> gradwatch.Finding:
    (f,) = report.by_check(ID)
    assert f.details["replaced"] == [layer], f.line()
    assert f"old parameters of '{layer}'" in f.message and "replaced" in f.message
    assert "Watch the whole model" not in f.hint and "rebuild the optimizer" in f.hint
    return f


def test_a_fine_tunes_head_swapped_after_the_optimizer_was_built() -> None:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.fc = nn.Linear(16, 1)  # the new task's head, after the optimizer
    _said_replaced(_loop(model, model, opt), "fc")


def test_a_head_swapped_between_watch_and_with() -> None:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def swap() -> None:
        model.fc = nn.Linear(16, 1)

    _said_replaced(_loop(model, model, opt, between=swap), "fc")


def test_a_weight_re_created_as_a_new_parameter() -> None:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.backbone[2].weight = nn.Parameter(torch.zeros(16, 16))  # "re-initialised"
    f = _said_replaced(_loop(model, model, opt), "backbone.2")
    assert len(f.params) == 1


def test_a_submodule_watched_keeps_the_watch_the_whole_model_hint() -> None:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    (f,) = _loop(model.backbone, model, opt).by_check(ID)
    assert "Watch the whole model" in f.hint and "replaced" not in f.details


def test_a_head_swapped_inside_the_watch_is_no_loose_leaf() -> None:
    """Swapped after ``with watch`` began, before the layout is read again: the new head's
    parameters are the model's own (not_in_optimizer says they are in no optimizer), never
    an ``unregistered_param`` loose leaf named ``model``."""
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        model.fc = nn.Linear(16, 1)
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    report = w.report()
    assert not report.by_check("unregistered_param"), [f.line() for f in report.findings]
    assert {f.module for f in report.by_check("not_in_optimizer")} == {"fc"}
