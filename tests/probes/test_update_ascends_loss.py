"""``update_ascends_loss``: optimizers whose step climbs the loss, and correct look-alikes.

Violating forms (practitioners' reports): a hand-written SGD with the update's sign flipped
(``p.data.add_(lr * p.grad)``, a classic of "my loss goes up" forum threads), Adam with
``maximize=True`` left on from a reward-maximising example, a negative learning rate
(``lr=-1e-3`` from a sweep or a schedule gone below 0), and a custom Adam-like optimizer whose
sign flip hides behind a preconditioner. Look-alikes: the first step of Adam, SGD with
Nesterov momentum, AdamW with a weight decay that dominates a tiny gradient, LBFGS (needs a
closure), SAM (an ascent inside the closure, a descent at the end), Langevin dynamics (random
noise), a GAN's optimizer whose other player's loss the probe is not given, a loss negated by
mistake.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "update_ascends_loss"
CFG = only(CHECK)


def _probe(model: nn.Module, opt: Any, loss_fn: Any = ce, batch: Any = None) -> gradwatch.Report:
    return gradwatch.probe(model, batch if batch is not None else data(), loss_fn, opt, config=CFG)


class FlippedSGD(torch.optim.Optimizer):
    """A hand-written SGD with its sign flipped: ``p.data.add_(lr * grad)``."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(group["lr"] * p.grad)
        return loss


class FlippedRMS(torch.optim.Optimizer):
    """An RMSprop-like step without a closure argument, sign flipped on the head only."""

    def __init__(self, params: Any, lr: float = 1e-2, flip: bool = False) -> None:
        super().__init__(params, {"lr": lr, "flip": flip})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            sign = 1.0 if group["flip"] else -1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                sq = self.state[p].setdefault("sq", torch.zeros_like(p))
                sq.mul_(0.9).addcmul_(p.grad, p.grad, value=0.1)
                p.add_(sign * group["lr"] * p.grad / (sq.sqrt() + 1e-8))


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation (Foret et al. 2021): ascend by rho inside, then descend."""

    def __init__(self, params: Any, lr: float = 0.1, rho: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        assert closure is not None, "SAM requires a closure"
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        eps = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    eps[p] = p.grad * group["rho"] / (norm + 1e-12)
                    p.add_(eps[p])
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p in eps:
                    p.sub_(eps[p])
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class Langevin(torch.optim.Optimizer):
    """SGLD (Welling & Teh 2011): a gradient step plus Gaussian noise of variance 2 lr."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    noise = torch.randn_like(p) * (2 * group["lr"]) ** 0.5
                    p.add_(-group["lr"] * p.grad + noise)
        return None


def _found(report: gradwatch.Report) -> list[gradwatch.Finding]:
    return findings(report, CHECK)


def test_a_hand_written_sgd_with_its_sign_flipped_is_an_error_naming_the_class() -> None:
    model = mlp()
    report = _probe(model, FlippedSGD(model.parameters(), lr=0.1))
    (f,) = _found(report)
    assert f.severity == "error" and "FlippedSGD" in f.message
    assert set(f.params) == {n for n, _ in model.named_parameters()}
    assert f.details["groups"][0]["cosine"] > 0.99


def test_maximize_left_on_is_an_error() -> None:
    model = mlp()
    report = _probe(model, torch.optim.Adam(model.parameters(), lr=1e-3, maximize=True))
    (f,) = _found(report)
    assert "Adam" in f.message and verdicts(report)[CHECK] == "finding"


def test_a_negative_learning_rate_in_one_group_names_that_group_only() -> None:
    model = mlp()
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "lr": 0.1},
            {"params": model[2].parameters(), "lr": -1e-3},
        ],
        momentum=0.9,
    )
    (f,) = _found(_probe(model, opt))
    assert set(f.params) == {"2.weight", "2.bias"}
    assert [g["status"] for g in f.details["groups"]] == ["descends", "ascends"]


def test_a_flipped_preconditioned_step_without_a_closure_argument_is_found() -> None:
    model = mlp()
    opt = FlippedRMS(
        [
            {"params": model[0].parameters()},
            {"params": model[2].parameters(), "flip": True},
        ]
    )
    (f,) = _found(_probe(model, opt))
    assert set(f.params) == {"2.weight", "2.bias"}


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        lambda ps: torch.optim.NAdam(ps, lr=1e-3),
        lambda ps: torch.optim.RAdam(ps, lr=1e-3),
        lambda ps: torch.optim.Rprop(ps),
        lambda ps: torch.optim.LBFGS(ps, lr=1.0),
        lambda ps: SAM(ps),
    ],
    ids=["adam", "nesterov", "rmsprop", "adagrad", "nadam", "radam", "rprop", "lbfgs", "sam"],
)
def test_the_first_step_of_correct_optimizers_descends(make: Callable[[Any], Any]) -> None:
    model = mlp()
    report = _probe(model, make(model.parameters()))
    assert _found(report) == [] and verdicts(report)[CHECK] == "passed"


def test_weight_decay_that_dominates_a_tiny_gradient_is_set_aside() -> None:
    """Near a fit, AdamW/SGD's pull towards 0 can raise the loss: not the update's sign."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(32, 4)
    y = model(x).detach() + 1e-6  # almost fitted: the gradient is tiny
    batch = (x, y)

    def mse(m: nn.Module, b: Any) -> Tensor:
        return F.mse_loss(m(b[0]), b[1])

    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5),
        torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5),
    ):
        report = _probe(model, opt, mse, batch)
        assert _found(report) == []
        assert report.probes[0].details["set_aside"] == ["weight_decay=0.5"]


def test_a_langevin_update_is_random_and_not_judged() -> None:
    model = mlp()
    report = _probe(model, Langevin(model.parameters(), lr=1e-4))
    assert _found(report) == []
    assert verdicts(report)[CHECK] == "not_observed"


def test_a_gan_optimizer_is_judged_only_on_the_groups_the_loss_reaches() -> None:
    """A generator's optimizer holds the generator only; the discriminator's groups that
    the (detached) discriminator loss does not reach are not judged."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 4), nn.Linear(4, 1)
    gan = nn.ModuleDict({"gen": gen, "disc": disc})
    opt = torch.optim.Adam([{"params": gen.parameters()}, {"params": disc.parameters()}], lr=2e-4)
    z, real = torch.randn(8, 2), torch.randn(8, 4)

    def d_loss(m: nn.Module, b: Any) -> Tensor:
        fake = m["gen"](b[0]).detach()
        ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
        bce = F.binary_cross_entropy_with_logits
        return bce(m["disc"](b[1]), ones) + bce(m["disc"](fake), zeros)

    report = _probe(gan, opt, d_loss, (z, real))
    assert _found(report) == []
    statuses = [g["status"] for g in report.probes[0].details["groups"]]
    assert statuses == ["no_gradient", "descends"]


def test_a_loss_negated_by_mistake_is_not_this_check() -> None:
    model = mlp()
    report = _probe(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: -ce(m, b))
    assert _found(report) == []


def test_without_an_optimizer_it_is_not_observed_and_the_user_state_is_untouched() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, maximize=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert _found(_probe(model, opt))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state == {} and all(p.grad is None for p in model.parameters())
    assert verdicts(_probe(model, None))[CHECK] == "not_observed"


def test_an_accelerate_wrapped_optimizer_is_re_created_from_the_one_it_wraps() -> None:
    """The Hugging Face Trainer and ``Accelerator.prepare`` hand over an
    ``AcceleratedOptimizer``: a torch ``Optimizer`` subclass whose constructor takes the
    optimizer it wraps, so re-creating its class over param groups failed."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # the process-wide singletons
    GradientState._reset_state()
    try:
        model = mlp()
        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert type(opt).__name__ == "AcceleratedOptimizer"
        report = gradwatch.probe(model, data(), ce, opt, config=only(CHECK))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert verdicts(report) == {CHECK: "passed"}
    assert report.probes[0].details["optimizer"].startswith("AdamW")
