"""A probe that cannot run on the user's step says so; it never raises, and its warnings stay its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import torch
from torch import nn

import gradwatch


class Energy(nn.Module):
    """An energy-based model: E(x) = MLP(x), a scalar per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.SiLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def langevin_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Contrastive divergence (CD-k): Langevin chains started at the data, as EBM recipes do.

    ``torch.autograd.grad`` on the chain frees the graph of each energy it differentiates,
    and the chain starts from the batch, so those energies depend on it.
    """
    neg = (batch + 0.01 * torch.randn_like(batch)).requires_grad_(True)
    for _ in range(3):
        (g,) = torch.autograd.grad(model(neg).sum(), neg)
        neg = (neg - 0.1 * g + 0.01 * torch.randn_like(neg)).detach().requires_grad_(True)
    return model(batch).mean() - model(neg.detach()).mean()


def test_a_probe_that_cannot_run_on_the_step_is_not_observed_never_an_exception() -> None:
    model = Energy()
    before = [p.detach().clone() for p in model.parameters()]
    report = gradwatch.probe(model, torch.randn(16, 4), langevin_loss)
    assert not report.failed
    assert all(p.verdict in ("passed", "not_observed", "explained") for p in report.probes)
    for rec in report.probes:
        if rec.verdict == "not_observed":
            assert rec.note, rec  # the reason is said
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_failing_step_gives_its_reason() -> None:
    def broken(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = model(batch)
        out.sum().backward()  # frees the graph the probe needs for its own backward
        return out.sum()

    report = gradwatch.probe(Energy(), torch.randn(8, 4), broken)
    blind = [p for p in report.probes if p.verdict == "not_observed"]
    assert blind, report.probes
    assert any("step failed" in p.note for p in blind)
    assert not report.failed


class Noisy(nn.Module):
    """A layer that warns on every forward, as third-party wrappers do on copies."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn(
            "Full backward hook is firing when gradients are computed", UserWarning, stacklevel=2
        )
        return self.lin(x)


def test_warnings_raised_on_the_copy_never_reach_the_user() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user's -W error
        report = gradwatch.probe(Noisy(), (torch.randn(8, 4), torch.randn(8, 1)), _mse)
    assert not report.failed
    assert all(p.details.get("reason") != "step_failed" for p in report.probes), report.probes
    assert any("Full backward hook" in w for p in report.probes for w in p.details["warnings"])


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def test_minus_w_error_in_a_fresh_interpreter() -> None:
    """The same as a user runs it: ``python -W error``, the probes pass, nothing is printed."""
    code = textwrap.dedent(
        """
        import warnings, torch
        from torch import nn
        import gradwatch

        class Noisy(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 1)
            def forward(self, x):
                warnings.warn("Full backward hook is firing", UserWarning)
                return self.lin(x)

        r = gradwatch.probe(Noisy(), (torch.randn(8, 4), torch.randn(8, 1)),
                            lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        print(sorted({str(p.details.get("reason")) for p in r.probes}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "step_failed" not in out.stdout, out.stdout
    assert "Full backward hook" not in out.stderr
