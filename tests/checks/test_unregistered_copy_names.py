"""``unregistered_param`` names a Parameter that only a copy of it holds, by that attribute.

``self.scale = nn.Parameter(torch.ones(16)).to(dtype)`` stores ``.to()``'s result, a plain
tensor computed from the Parameter; the Parameter itself is held by that copy's graph only
(no module, no optimizer). Three forms: a root attribute converted with ``.to(dtype)``, a
submodule's positional table converted with ``.double()``, and a temperature in the
training script moved with ``.to()``. Each is named by what holds the copy, not by its
shape. Its look-alike (convert first, then wrap) is a registered Parameter: silent.
"""

from __future__ import annotations

import torch
from _check_loops import run_steps
from torch import nn

import gradwatch


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.ones(16)).to(torch.float64)  # the bug
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x) * self.scale.float())


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.pos = nn.Parameter(torch.zeros(1, 16)).double()  # the bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.pos.float()


class WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.enc(x)))


def _plain(model: nn.Module) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return run_steps(model, opt, body, steps=4)


def _loose(report: gradwatch.Report) -> gradwatch.Finding:
    (f,) = report.by_check("unregistered_param")
    assert f.details["cause"] == "loose"
    return f


def test_a_root_attribute_converted_after_wrapping_is_named() -> None:
    torch.manual_seed(0)
    f = _loose(_plain(Scaled()))
    assert f.params == ["scale"] and f.message.startswith("'scale'")
    assert f.details["copied"] is True
    assert "nn.Parameter(t.to(...))" in f.hint


def test_a_submodule_table_converted_with_double_is_named() -> None:
    torch.manual_seed(0)
    f = _loose(_plain(WithEncoder()))
    assert f.params == ["enc.pos"] and f.details["shapes"] == [[1, 16]]


def test_a_temperature_moved_in_the_training_script_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    temperature = nn.Parameter(torch.tensor(1.0)).to(torch.float64)  # the bug
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x) / temperature.float(), y).backward()
        opt.step()

    f = _loose(run_steps(model, opt, body, steps=4))
    assert f.params == ["temperature"]


def test_converting_before_wrapping_is_silent() -> None:
    class Fixed(Scaled):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16).to(torch.float64))

    torch.manual_seed(0)
    assert not _plain(Fixed()).by_check("unregistered_param")
