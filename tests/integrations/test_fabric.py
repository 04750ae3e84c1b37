"""Lightning Fabric: ``fabric.setup(model, optimizer)`` wrappers watched as the user's own.

A real ``Fabric`` on the CPU: its ``_FabricModule`` and ``_FabricOptimizer`` go to
``watch()`` as they are; findings carry the user's parameter names, without Fabric's
``_forward_module.`` prefix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _loops import SideNet
from torch import nn

import gradwatch
from gradwatch.model.compiled import is_compiled

fabric_mod = pytest.importorskip("lightning.fabric")


def _train(use_side: bool, precision: str, zero_grad: bool = True) -> gradwatch.Report:
    fabric: Any = fabric_mod.Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    model = SideNet(use_side)
    module, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(module, opt, config={"every_n_steps": 1}) as w:
        for _ in range(6):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            if zero_grad:
                opt.zero_grad()
            fabric.backward(nn.functional.mse_loss(module(x).float(), y))
            fabric.clip_gradients(module, opt, max_norm=1.0)
            opt.step()
    return w.report()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_clean_fabric_loop_is_silent(precision: str) -> None:
    report = _train(use_side=True, precision=precision)
    assert report.steps == 6
    assert not report.findings, [f.line() for f in report.findings]


def test_ghost_and_missing_zero_grad_carry_the_users_names() -> None:
    ghost = _train(use_side=False, precision="32-true")
    (finding,) = ghost.by_check("ghost_param")
    assert finding.module == "side" and finding.params == ["side.weight", "side.bias"]
    assert finding.details["cause"] == "not_called"
    piled = _train(use_side=True, precision="32-true", zero_grad=False)
    (finding,) = piled.by_check("missing_zero_grad")
    assert all(not name.startswith("_forward_module") for name in finding.params)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")  # inductor's
def test_a_compiled_module_inside_fabric_counts_as_compiled() -> None:
    fabric: Any = fabric_mod.Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_module(torch.compile(nn.Linear(2, 2)))  # not compiled until called
    assert is_compiled(wrapped)
    assert not is_compiled(fabric.setup_module(nn.Linear(2, 2)))
