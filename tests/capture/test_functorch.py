"""Models called inside ``torch.func`` transforms, and gradients written by hand.

Per-sample gradients (``vmap(grad(...))`` over ``functional_call``: DP-SGD, per-example
gradient norms for data pruning) call the watched model's modules inside a transform, where
their tensors are wrapped; gradwatch's forward probes must stay out of it. A loop whose every
gradient is written into ``.grad`` by hand (DP-SGD) is judged on those gradients: they are
the step's, as if a backward pass had accumulated them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from _wrappers import ghost_model
from torch import nn
from torch.func import functional_call, grad, vmap

import gradwatch

STEPS = 6


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model["b"](torch.tanh(model["a"](x)))  # type: ignore[index]


def _batch(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    class Fwd(nn.Module):  # the ModuleDict's forward, for functional_call
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _forward(self.m, x)

    fwd = Fwd()
    params = {f"m.{n}": p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, Any], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(fwd, p, (xi[None],))
        return nn.functional.mse_loss(out, yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return {n[2:]: g for n, g in per.items()}


def test_per_sample_norms_next_to_a_normal_loop() -> None:
    """The usual loop plus per-example gradient norms each step: checks unchanged."""
    for ghost in (False, True):
        model = ghost_model(5, ghost)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
            for s in range(STEPS):
                x, y = _batch(s)
                norms = torch.stack(
                    [g.flatten(1).norm(dim=1) for g in _per_sample_grads(model, x, y).values()]
                )
                assert norms.shape[1] == 8
                opt.zero_grad()
                nn.functional.mse_loss(_forward(model, x), y).backward()
                opt.step()
        report = w.report()
        checks = {f.check for f in report.findings}
        assert checks == ({"ghost_param"} if ghost else set()), report.findings
        assert report.backward_passes == STEPS and report.steps == STEPS


def _dp_sgd(model: nn.ModuleDict, config: dict[str, Any]) -> gradwatch.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config=config) as w:
        for s in range(STEPS):
            x, y = _batch(s)
            per = _per_sample_grads(model, x, y)
            opt.zero_grad()
            for n, p in model.named_parameters():
                if n in per:
                    p.grad = per[n].clamp(-1.0, 1.0).mean(0)  # clipped and averaged, by hand
            opt.step()
    return w.report()


def test_dp_sgd_with_hand_written_gradients_is_judged_and_clean() -> None:
    """DP-SGD: per-sample gradients clipped, averaged and written into ``.grad``, then a
    normal step. Those gradients are the step's: judged, measured, and the run passes."""
    report = _dp_sgd(ghost_model(5, ghost=False), {"every_n_steps": 1})
    assert not report.failed and report.findings == [], report.findings
    assert report.backward_passes == 0 and report.steps == STEPS
    assert all(layer.steps_with_grad == STEPS for layer in report.layers), report.layers


def test_dp_sgd_still_finds_a_ghost() -> None:
    """A layer the per-sample loss never reaches gets zeros from ``grad``: still a ghost."""
    report = _dp_sgd(ghost_model(5, ghost=True), {})
    assert [sorted(f.params) for f in report.by_check("ghost_param")] == [
        ["ghost.bias", "ghost.weight"]
    ]
    assert {f.check for f in report.findings} == {"ghost_param"}


def test_a_step_without_backward_in_a_normal_loop_is_not_hand_written() -> None:
    """``step()`` twice for one backward (a double update) leaves the same ``.grad``."""
    model = ghost_model(5, ghost=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(_forward(model, x), y).backward()
            opt.step()
            opt.step()
    reasons = [f.details.get("reason") for f in w.report().by_check("not_observed")]
    assert reasons == [] and w.report().by_check("double_update")


def _backward_and_by_hand(
    model: nn.ModuleDict, by_hand: str, grad: Callable[[torch.Tensor, int], torch.Tensor]
) -> gradwatch.Report:
    """``a`` -> ``b`` trained by backward; layer ``by_hand`` gets ``grad(p, step)`` written."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            nn.functional.mse_loss(_forward(model, x), y).backward()
            for p in model[by_hand].parameters():
                p.grad = grad(p, s)
            opt.step()
    return w.report()


def test_a_layer_given_hand_written_gradients_is_no_ghost() -> None:
    """Backward trains most layers; one gets its gradient written by hand (a local learning
    rule, a PCGrad-style merge): it got a gradient. The unused layer next to it is a ghost."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "a": nn.Linear(5, 5),
            "b": nn.Linear(5, 1),
            "rule": nn.Linear(5, 5),
            "unused": nn.Linear(5, 5),
        }
    )
    report = _backward_and_by_hand(model, "rule", lambda p, s: 0.01 * torch.ones_like(p))
    assert [sorted(f.params) for f in report.by_check("ghost_param")] == [
        ["unused.bias", "unused.weight"]
    ]
    assert {f.check for f in report.findings} == {"ghost_param"}


def test_a_nan_in_a_hand_written_gradient_is_named_as_such() -> None:
    model = ghost_model(5, ghost=True)  # "ghost" is trained by hand only

    def grad(p: torch.Tensor, s: int) -> torch.Tensor:
        return torch.ones_like(p) / (0.0 if s == 3 else 1.0)  # Inf at step 3

    report = _backward_and_by_hand(model, "ghost", grad)
    (f,) = report.by_check("nonfinite_grad")
    assert sorted(f.params) == ["ghost.bias", "ghost.weight"] and f.first_step == 3
    assert "no backward pass made (set by hand)" in f.message and "into .grad itself" in f.hint
    # The hand-written gradients are measured: the Inf update left Inf weights that the later
    # (finite) hand-written gradients cannot repair, which nonfinite_param may say too.
    assert {x.check for x in report.findings} - {"nonfinite_param"} == {"nonfinite_grad"}
