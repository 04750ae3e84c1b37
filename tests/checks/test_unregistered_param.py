"""``unregistered_param``: layers kept in a plain list or dict that no optimizer sees.

Real loops: each real form of the bug fires, its look-alikes stay silent.
"""

from __future__ import annotations

import torch
from _check_loops import errors_of as _errors
from _check_loops import run_steps as _run
from _loops import batches
from torch import nn

import gradwatch


class ListBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = [nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8))]  # the bug
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class DictHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = {"a": nn.Linear(8, 1), "b": nn.Linear(8, 1)}  # the bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.heads["a"](h) + self.heads["b"](h)


def _plain_loop(model: nn.Module, steps: int = 3) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return _run(model, opt, body, steps=steps)


def test_layers_in_a_plain_list_are_unregistered() -> None:
    report = _plain_loop(ListBlocks())
    found = report.by_check("unregistered_param")
    params = {p for f in found for p in f.params}
    assert params == {
        "blocks[0].weight",
        "blocks[0].bias",
        "blocks[1].1.weight",
        "blocks[1].1.bias",
    }
    assert {f.module for f in found} == {"blocks[0]", "blocks[1].1"}
    assert all(f.severity == "error" and "nn.ModuleList" in f.hint for f in found)
    assert all(f.count == 1 for f in found)


def test_heads_in_a_plain_dict_are_unregistered() -> None:
    report = _plain_loop(DictHeads())
    params = {p for f in report.by_check("unregistered_param") for p in f.params}
    assert params == {
        "heads['a'].weight",
        "heads['a'].bias",
        "heads['b'].weight",
        "heads['b'].bias",
    }


def test_hidden_frozen_or_no_grad_modules_are_not_unregistered() -> None:
    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Linear(8, 1)
            teacher = nn.Linear(8, 1)
            self._teacher = [teacher]  # hidden on purpose: not saved, not trained
            self.frozen_proj = (nn.Linear(8, 8).requires_grad_(False),)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                soft = self._teacher[0](x)
            return self.student(self.frozen_proj[0](x)) + 0 * soft

    report = _plain_loop(Distill())
    assert _errors(report) == set(), [f.line() for f in report.findings]


def test_scan_stops_after_scan_steps() -> None:
    model = ListBlocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(
        model, opt, config={"checks": {"unregistered_param": {"scan_steps": 1}}}
    ) as w:
        for k, (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if k == 0:
                assert w._pipe.scout._global is None
        assert not w._pipe.scout.scanning
    assert w.report().by_check("unregistered_param")
    hooks = nn.modules.module._global_forward_hooks
    assert not hooks, "the global hook must be gone"
