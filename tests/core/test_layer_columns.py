"""The per-layer fold on the device (measure/columns.py) against the host's per-parameter fold,
on real training loops: the report's layer statistics agree, and each path is really taken."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.core import gather, layers


class Mixed(nn.Module):
    """Layers of one to three tensors, shapes that repeat and ones that do not, an embedding
    with rows no batch looks up (zeros in its gradient), a bias-free layer, a norm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        self.proj = nn.Linear(8, 12, bias=False)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).mean(1)
        return self.head(self.norm(self.proj(torch.tanh(self.blocks(h)))))


def _count_folds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the steps whose layer samples came from the device's fold."""
    calls = {"folded": 0}
    real = layers.folded_samples

    def counting(*a: object, **k: object) -> object:
        calls["folded"] += 1
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(gather, "folded_samples", counting)
    return calls


def _train(fold: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 6) -> dict[str, tuple]:
    calls = _count_folds(monkeypatch)
    if not fold:
        monkeypatch.setattr(gather, "_fold_chunk", lambda *a, **k: None)
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(steps):
            ids = torch.randint(0, 20, (16, 4), generator=g)  # rows 20-49: zero gradient
            y = torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids), y).backward()
            opt.step()
    monkeypatch.undo()
    assert (calls["folded"] == steps) if fold else (calls["folded"] == 0)
    return {
        layer.name: (
            layer.grad_norm_last,
            layer.grad_norm_max,
            layer.mean_abs_grad,
            layer.max_abs_grad,
            layer.zero_fraction,
            layer.param_norm,
            layer.update_ratio,
        )
        for layer in w.report().layers
    }


def test_the_device_fold_equals_the_host_fold_on_a_real_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on, off = _train(True, monkeypatch), _train(False, monkeypatch)
    assert set(on) == set(off) and len(on) == 10
    for name in on:
        for a, b in zip(on[name], off[name]):
            assert a is not None and b is not None, name
            assert a == pytest.approx(b, rel=1e-5, abs=1e-12), name
    assert on["embed"][4] >= 30 / 50  # rows 20-49 are never looked up


def test_the_folded_values_are_the_gradients_and_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Against a direct computation at the last step (SGD: the update is -lr * grad)."""
    calls = _count_folds(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 5), torch.randn(32, 2)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            opt.step()
    assert calls["folded"] == 3
    got = {layer.name: layer for layer in w.report().layers}
    for name in ("0", "2"):
        gs = [grads[f"{name}.weight"], grads[f"{name}.bias"]]
        ps = [getattr(model, name).weight.detach(), getattr(model, name).bias.detach()]
        numel = sum(g.numel() for g in gs)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in gs))
        pnorm = math.sqrt(sum(float(p.pow(2).sum()) for p in ps))
        layer = got[name]
        assert layer.grad_norm_last == pytest.approx(norm, rel=1e-5)
        assert layer.mean_abs_grad == pytest.approx(sum(float(g.abs().sum()) for g in gs) / numel)
        assert layer.max_abs_grad == pytest.approx(max(float(g.abs().max()) for g in gs))
        nonzero = sum(int(g.count_nonzero()) for g in gs)
        assert layer.zero_fraction == pytest.approx(1 - nonzero / numel)
        assert layer.param_norm == pytest.approx(pnorm, rel=1e-5)
        # every value is sampled in tensors this small: the update norm is exact
        assert layer.update_ratio == pytest.approx(0.1 * norm / pnorm, rel=1e-4)


def test_a_non_finite_step_is_folded_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN gradient: the step takes the host's fold (NaN and Inf as before), then the next
    finite step the device's again."""
    seen: list[bool] = []
    real_samples = gather.layer_samples

    def spy(g: object, numel: object, track: object) -> object:
        seen.append(g.folded is not None and not any(g.nonfinite))  # type: ignore[attr-defined]
        return real_samples(g, numel, track)  # type: ignore[arg-type]

    from gradwatch.core import steps

    monkeypatch.setattr(steps, "layer_samples", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k in range(3):
            opt.zero_grad()
            out = model(x).sum()
            (out * float("nan") if k == 1 else out).backward()
            kept = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if k == 1:  # the NaN step's update undone, as a loop that skips it would
                with torch.no_grad():
                    for p, v in zip(model.parameters(), kept):
                        p.copy_(v)
    assert seen == [True, False, True]
    assert "nonfinite_grad" in {f.check for f in w.report().findings}
