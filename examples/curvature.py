"""Curvature report: which layers the loss is most sensitive to, and what that means.

``gradwatch.sensitivity`` estimates each layer's Hessian trace (Hutchinson, with a
standard error) and top eigenvalue (power iteration) from Hessian-vector products. The
top eigenvalue bounds the learning rate: plain gradient descent diverges when
``lr > 2 / lambda_max(H)``, and ``lambda_max(H)`` is at least every layer's block
eigenvalue, so ``2 / max(top_eigenvalue)`` is an upper bound on a stable rate and the
layer holding the maximum is the one that limits it. Here a regressor with one input
feature in the hundreds has curvature hundreds of times larger than the same model on
normalised inputs.

The CLI does the same for a Probe: ``gradwatch check examples/curvature.py:build
--curvature --json report.json``, then ``gradwatch report report.json --html report.html``
draws the per-layer chart.

Run with ``python examples/curvature.py`` (gradwatch importable; the HTML needs matplotlib).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gradwatch


def data(normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g) * torch.tensor([1.0, 1.0, 1.0, 50.0])
    y = x[:, :1] + x[:, 3:] / 50.0
    if normalise:
        x = (x - x.mean(0)) / x.std(0)
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(batch[0]), batch[1])


def build() -> gradwatch.Probe:
    """The probe ``gradwatch check --curvature`` runs (raw, unnormalised inputs)."""
    return gradwatch.Probe(model(), data(normalise=False), loss_fn)


def main(out: Path) -> dict[str, gradwatch.Curvature]:
    curves = {}
    for label, normalise in (("raw", False), ("normalised", True)):
        curv = gradwatch.sensitivity(model(), data(normalise), loss_fn, samples=16, seed=0)
        top = max(curv.layers, key=lambda c: c.top_eigenvalue)
        print(f"\n{label} inputs, loss {curv.loss:.3f} ({curv.hvps} Hessian-vector products)")
        print(curv.table())
        print(
            f"largest block eigenvalue {top.top_eigenvalue:.3g} in layer {top.name!r}: "
            f"plain SGD needs lr < {2 / top.top_eigenvalue:.2g}"
        )
        curves[label] = curv
    worst = {k: max(c.top_eigenvalue for c in v.layers) for k, v in curves.items()}
    assert worst["raw"] > 50 * worst["normalised"], worst

    probe = build()
    report = probe.run(steps=3)
    report.curvature = probe.curvature(samples=16)
    report.write(out / "curvature-report.json")
    try:
        report.to_html(out / "curvature-report.html")
        print(f"\nwrote {out / 'curvature-report.html'}")
    except ImportError as exc:  # matplotlib missing: the JSON report still has the numbers
        print(f"no HTML: {exc}")
    return curves


if __name__ == "__main__":
    main(Path.cwd())
