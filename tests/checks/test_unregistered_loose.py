"""``unregistered_param`` for loose leaves: tensors the loss trains that no optimizer holds.

Real loops: a margin head kept in the script, a criterion module outside the model, a plain
``requires_grad`` tensor attribute, a parameter re-created by ``nn.Parameter(p.to(...))``
after the optimizer was built, loss weights left out of the optimizer. Look-alikes that
must stay silent: a learnable temperature held in the optimizer, adversarial examples,
PGD's per-batch perturbation, a gradient penalty on interpolates (``create_graph=True``),
and a second model trained by an optimizer gradwatch does not watch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _check_loops import run_steps
from torch import nn

import gradwatch
from gradwatch.checks.unregistered import UnregisteredParam

ID = UnregisteredParam.id


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loose(report: gradwatch.Report) -> list[gradwatch.Finding]:
    return [f for f in report.by_check(ID) if f.details.get("cause") == "loose"]


class ArcMargin(nn.Module):
    """An ArcFace-style margin head: the class centres are its weight."""

    def __init__(self, dim: int = 4, classes: int = 3, s: float = 8.0, m: float = 0.3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, dim))
        self.s, self.m = s, m

    def forward(self, emb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cos = nn.functional.normalize(emb) @ nn.functional.normalize(self.weight).t()
        theta = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))
        target = torch.cos(theta + self.m)
        onehot = nn.functional.one_hot(y, cos.shape[1]).bool()
        logits = self.s * torch.where(onehot, target, cos)
        return nn.functional.cross_entropy(logits, y)


def _labels(y: torch.Tensor) -> torch.Tensor:
    return (y[:, 0] > 0).long() + (y[:, 0] > 1).long()


# -- the bug ----------------------------------------------------------------------------------


def test_margin_head_parameter_created_in_the_script() -> None:
    model = _net()
    W = nn.Parameter(torch.randn(4, 3))  # ArcFace centres kept next to the loop
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # W forgotten

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        logits = nn.functional.normalize(model(x)) @ nn.functional.normalize(W, dim=0)
        nn.functional.cross_entropy(8 * logits, _labels(y)).backward()  # the backward
        opt.step()

    (f,) = _loose(run_steps(model, opt, body))
    assert f.severity == "error" and f.params == ["W"] and f.first_step == 1
    assert f.details["parameter"] is True and f.details["shapes"] == [[4, 3]]
    lines = Path(__file__).read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.endswith("# the backward")]
    assert f.details["backward_at"].endswith(f"{Path(__file__).name}:{n}")
    assert "'W'" in f.message and "no optimizer" in f.message


def test_criterion_module_outside_the_model() -> None:
    model = _net()
    criterion = ArcMargin()  # a module, but not a submodule of the model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        criterion(model(x), _labels(y)).backward()
        opt.step()

    (f,) = _loose(run_steps(model, opt, body))
    assert f.params == ["criterion.weight"] and "'criterion'" in f.message


class Clip(nn.Module):
    """CLIP-style head whose temperature is a plain tensor, not an ``nn.Parameter``."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(8, 4)
        self.txt = nn.Linear(8, 4)
        self.temperature = torch.tensor(math.log(1 / 0.07), requires_grad=True)  # the bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = nn.functional.normalize(self.img(x))
        b = nn.functional.normalize(self.txt(x.flip(0)))
        return self.temperature.exp() * a @ b.t()


def test_plain_tensor_attribute_with_requires_grad_is_no_parameter() -> None:
    model = Clip()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        logits = model(x)
        nn.functional.cross_entropy(logits, torch.arange(len(x))).backward()
        opt.step()

    (f,) = _loose(run_steps(model, opt, body))
    assert f.params == ["temperature"] and f.details["parameter"] is False


def test_parameter_recreated_by_a_to_copy_after_the_optimizer_was_built() -> None:
    """Prompt tuning with a trainable head: the optimizer holds the prompt, then
    ``nn.Parameter(p.to(...))`` replaces it: the loss trains the copy, the optimizer steps
    the orphan."""
    model = _net()
    model[0].requires_grad_(False)
    prompt = nn.Parameter(torch.zeros(1, 8))
    opt = torch.optim.SGD([*model[2].parameters(), prompt], lr=0.1)
    prompt = nn.Parameter(prompt.to(torch.float32, copy=True))  # "move it to the device"

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x + prompt)[:, :1], y).backward()
        opt.step()

    found = _loose(run_steps(model, opt, body))
    assert [f.params for f in found] == [["prompt"]]


def test_loss_weights_left_out_of_the_optimizer() -> None:
    """Uncertainty weighting of two task losses (Kendall et al.): ``log_vars`` never learns."""
    model = _net()
    log_vars = torch.zeros(2, requires_grad=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        out = model(x)
        losses = torch.stack(
            [nn.functional.mse_loss(out[:, :1], y), nn.functional.l1_loss(out[:, 1:2], y)]
        )
        (torch.exp(-log_vars) * losses + log_vars).sum().backward()
        opt.step()

    (f,) = _loose(run_steps(model, opt, body))
    assert f.params == ["log_vars"] and f.details["shapes"] == [[2]]


# -- look-alikes ------------------------------------------------------------------------------


def test_learnable_temperature_held_by_the_optimizer_is_silent() -> None:
    model = _net()
    logit_scale = nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.AdamW([*model.parameters(), logit_scale], lr=1e-3)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        logits = logit_scale.exp() * nn.functional.normalize(model(x)) @ torch.eye(4, 3)
        nn.functional.cross_entropy(logits, _labels(y)).backward()
        opt.step()

    assert not run_steps(model, opt, body, steps=5).by_check(ID)


def test_adversarial_examples_and_input_saliency_are_silent() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.clone().requires_grad_()  # FGSM: the input's gradient
        nn.functional.mse_loss(model(x)[:, :1], y).backward()
        x_adv = (x + 0.03 * x.grad.sign()).detach()
        opt.zero_grad()
        nn.functional.mse_loss(model(x_adv)[:, :1], y).backward()
        opt.step()

    assert not run_steps(model, opt, body, steps=5).by_check(ID)


def test_pgd_perturbation_per_batch_is_silent() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        delta = torch.zeros_like(x, requires_grad=True)  # one per batch, 3 inner steps
        for _ in range(3):
            nn.functional.mse_loss(model(x + delta)[:, :1], y).backward()
            with torch.no_grad():
                delta += 0.01 * delta.grad.sign()
                delta.clamp_(-0.03, 0.03)
            delta.grad = None
        opt.zero_grad()
        nn.functional.mse_loss(model(x + delta.detach())[:, :1], y).backward()
        opt.step()

    assert not run_steps(model, opt, body, steps=5).by_check(ID)


def test_wgan_gp_with_an_unwatched_generator_is_silent() -> None:
    """The critic is watched; the generator trains with its own optimizer, and the gradient
    penalty differentiates through fresh interpolates with ``create_graph=True``."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.0, 0.9))

    def body(k: int, real: torch.Tensor, y: torch.Tensor) -> None:
        fake = gen(torch.randn(len(real), 4))
        alpha = torch.rand(len(real), 1)
        interp = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
        (grad,) = torch.autograd.grad(critic(interp).sum(), interp, create_graph=True)
        penalty = 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
        opt_d.zero_grad()
        (critic(fake.detach()).mean() - critic(real).mean() + penalty).backward()
        opt_d.step()
        opt_g.zero_grad()
        (-critic(fake).mean()).backward()  # reaches the generator: its own optimizer steps it
        opt_g.step()

    assert not run_steps(critic, opt_d, body, steps=5).by_check(ID)


def test_loose_search_off_by_config() -> None:
    model = _net()
    W = nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        (model(x) @ W).pow(2).mean().backward()
        opt.step()

    cfg = {"checks": {ID: {"loose_tensors": False}}}
    assert not run_steps(model, opt, body, **cfg).by_check(ID)


def test_tensor_backward_is_restored_after_exit() -> None:
    original = torch.Tensor.backward
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt):
        assert torch.Tensor.backward is not original
        with gradwatch.watch(_net()):
            pass  # a nested watcher closing leaves the outer one listening
        assert torch.Tensor.backward is not original
    assert torch.Tensor.backward is original


@pytest.mark.parametrize("steps", [1])
def test_one_step_is_not_enough_to_call_a_leaf_loose(steps: int) -> None:
    """A leaf seen in one step only may be an input: it takes a second step to tell."""
    model = _net()
    W = nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        (model(x) @ W).pow(2).mean().backward()
        opt.step()

    assert not run_steps(model, opt, body, steps=steps).by_check(ID)


# -- frameworks that build the optimizer for you ---------------------------------------------


class ScaledNet(nn.Module):
    """DIM -> 1 with a learnable output scale kept as a plain tensor (the bug)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.scale = torch.ones(1, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_module_with_a_plain_tensor_scale(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    from _regime import lightning_fit

    (f,) = _loose(lightning_fit(ScaledNet(), tmp_path))
    assert f.params == ["net.scale"] and f.severity == "error"


def test_hf_trainer_model_with_a_plain_tensor_scale(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _regime import LossOf, hf_train

    (f,) = _loose(hf_train(LossOf(ScaledNet()), tmp_path))
    assert f.params == ["net.scale"]


def test_hf_trainer_scale_as_a_parameter_is_silent(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _regime import LossOf, hf_train

    net = ScaledNet()
    net.scale = nn.Parameter(net.scale.detach())  # registered: the Trainer's optimizer has it
    assert not hf_train(LossOf(net), tmp_path).by_check(ID)


def test_another_wrapper_of_tensor_backward_on_top_is_kept_working() -> None:
    """A library that wraps ``Tensor.backward`` after gradwatch: closing and watching again
    neither recurses nor loses it."""
    calls: list[int] = []
    real = torch.Tensor.backward
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    W = nn.Parameter(torch.randn(4, 3))
    with gradwatch.watch(model, opt):
        below = torch.Tensor.backward

        def theirs(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return below(self, *args, **kwargs)

        torch.Tensor.backward = theirs  # type: ignore[method-assign]
    try:

        def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            (model(x) @ W).pow(2).mean().backward()
            opt.step()

        (f,) = _loose(run_steps(model, opt, body))
        assert f.params == ["W"] and len(calls) == 4
    finally:
        torch.Tensor.backward = below  # type: ignore[method-assign]
    with gradwatch.watch(model, opt):
        pass  # gradwatch's wrapper on top again: the last exit puts torch's own back
    assert torch.Tensor.backward is real


def test_teacher_in_eval_without_no_grad_is_a_warning() -> None:
    """Distillation whose teacher runs outside ``torch.no_grad()``: its parameters get
    gradients nobody uses (a warning: memory and time, not a model that fails to train)."""
    model = _net()
    teacher = _net().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        soft = nn.functional.softmax(teacher(x), dim=-1)  # no torch.no_grad()
        nn.functional.cross_entropy(model(x), soft).backward()
        opt.step()

    (f,) = _loose(run_steps(model, opt, body))
    assert f.severity == "warning" and f.details["in_eval"] is True
    assert sorted(f.params) == [
        "teacher.0.bias",
        "teacher.0.weight",
        "teacher.2.bias",
        "teacher.2.weight",
    ]
    assert "torch.no_grad()" in f.hint


def test_teacher_under_no_grad_is_silent() -> None:
    model = _net()
    teacher = _net().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(k: int, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        with torch.no_grad():
            soft = nn.functional.softmax(teacher(x), dim=-1)
        nn.functional.cross_entropy(model(x), soft).backward()
        opt.step()

    assert not run_steps(model, opt, body).by_check(ID)
