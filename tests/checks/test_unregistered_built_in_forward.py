"""``unregistered_param``: layers built inside ``forward``, a new random layer at every call.

Three forms seen in tutorials: a projection built inline, a LayerNorm sized from its input,
and a ResNet shortcut whose 1x1 projection is built when the channel counts differ. Each is
gone when the forward returns (only the graph holds its parameters), so the scout has to
note it while it runs. Look-alikes stay silent: a lazy layer, a helper layer built under
``no_grad`` (a fixed random projection), and a frozen one.
"""

from __future__ import annotations

import torch
from _check_loops import errors_of as _errors
from _check_loops import run_steps as _run
from torch import nn

import gradwatch


class InlineProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = nn.Linear(16, 16)(h)  # the bug: a new projection at every call
        return self.out(h)


class NormFromShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = nn.LayerNorm(h.shape[-1])(h)  # the bug: sized from the input, built every call
        return self.out(torch.tanh(h))


class Shortcut(nn.Module):
    """A residual block whose projection shortcut is built when the channels differ."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        if x.shape[1] != out.shape[1]:
            x = nn.Conv2d(x.shape[1], out.shape[1], 1)(x)  # the bug
        return torch.relu(out + x)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(Shortcut(2, 4), Shortcut(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img = x.reshape(-1, 2, 2, 2)
        return self.head(self.body(img).mean(dim=(2, 3)))


def _plain_loop(model: nn.Module, steps: int = 3) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return _run(model, opt, body, steps=steps)


def _built(report: gradwatch.Report) -> list[gradwatch.Finding]:
    return [
        f
        for f in report.by_check("unregistered_param")
        if f.details.get("cause") == "built_in_forward"
    ]


def test_a_projection_built_inline_in_forward_fires() -> None:
    found = _built(_plain_loop(InlineProjection()))
    assert len(found) == 1, found
    f = found[0]
    assert f.severity == "error" and f.details["module_class"] == "Linear"
    assert f.details["called_at"].endswith(f"{__name__.rsplit('.', 1)[-1]}.py:28")
    assert "built inside the model's forward" in f.message and "__init__" in f.hint
    assert sorted(p.rsplit(".", 1)[1] for p in f.params) == ["bias", "weight"]
    assert f.count == 3  # a new one at each step, one finding


def test_a_layer_norm_sized_from_its_input_fires() -> None:
    found = _built(_plain_loop(NormFromShape()))
    assert [f.details["module_class"] for f in found] == ["LayerNorm"]
    assert "nn.LayerNorm" in found[0].hint


def test_a_shortcut_projection_built_when_channels_differ_fires() -> None:
    found = _built(_plain_loop(TinyResNet()))
    assert [f.details["module_class"] for f in found] == ["Conv2d"], found
    # only the first block's shapes differ: its forward is the line named
    assert found[0].details["called_at"] is not None


def test_look_alikes_built_inside_forward_are_silent() -> None:
    class Lazy(nn.Module):  # registered at __init__, materialised at the first call
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.LazyLinear(16)
            self.out = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.inp(x)))

    class FixedRandomProjection(nn.Module):  # built under no_grad, or frozen: not trained
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.out = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            with torch.no_grad():
                noise = nn.Linear(8, 16)(x)
            frozen = nn.Linear(16, 16).requires_grad_(False)
            return self.out(frozen(h) + 0.01 * noise)

    lazy = Lazy()
    lazy(torch.zeros(1, 8))  # materialised before the optimizer is built, as documented
    for model in (lazy, FixedRandomProjection()):
        report = _plain_loop(model)
        assert _errors(report) == set(), [f.line() for f in report.findings]
        assert not report.by_check("unregistered_param")
