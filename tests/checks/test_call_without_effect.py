"""``call_without_effect``: a state change asked for that does not hold at the next step.

Violating forms, as practitioners report them: a Lightning checkpoint's ``model.``-prefixed
keys loaded with ``strict=False`` (pytorch/examples#1029), a ``DataParallel`` checkpoint's
``module.`` keys (pytorch/pytorch#3805) and ``torch.compile``'s ``_orig_mod.``; an
optimizer built again after its scheduler, so the schedule drives the old one; ``opt.lr =``
and ``opt.defaults['lr'] =`` instead of the param groups; an encoder put in eval (dropout
off) or frozen, undone by ``model.train()`` / ``model.requires_grad_(True)`` at the epoch's
start. Clean twins: a fine-tuning load with a new head, validation's ``eval()``/``train()``,
gradual unfreezing, a partial unfreeze by hand, a scheduler on the stepped optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from _check_loops import CFG
from torch import nn

import gradwatch
from gradwatch import _loads

ID = "call_without_effect"


class Net(nn.Module):
    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def _run(model: nn.Module, opt: Any, before: Callable[[int], None], steps: int = 3) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, config=CFG) as w:
        for k in range(steps):
            before(k)
            x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return [f for f in w.report().findings if f.check == ID]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _once(fn: Callable[[], Any], at: int = 0) -> Callable[[int], None]:
    return lambda k: None if k != at else fn()


@pytest.mark.parametrize("prefix", ["model.", "module.", "_orig_mod."])
def test_a_prefixed_checkpoint_loaded_non_strict_loads_nothing(prefix: str) -> None:
    torch.manual_seed(0)
    saved = {prefix + k: v for k, v in Net().state_dict().items()}
    model = Net()
    (f,) = _run(model, _sgd(model), _once(lambda: model.load_state_dict(saved, strict=False)))
    assert f.severity == "warning" and f.details["kind"] == "load_state_dict"
    assert f.details["loaded"] == 0 and f.details["pairs"][0][1].startswith(prefix)
    assert "test_call_without_effect.py" in f.details["called_at"]
    assert "enc.0.weight" in f.params


def test_a_backbone_checkpoint_loaded_into_the_whole_model_by_its_submodule_names() -> None:
    torch.manual_seed(0)
    saved = {"backbone." + k: v for k, v in Net().enc.state_dict().items()}
    model = Net()
    (f,) = _run(model, _sgd(model), _once(lambda: model.enc.load_state_dict(saved, strict=False)))
    assert f.module == "enc" and f.details["pairs"][0] == ["0.weight", "backbone.0.weight"]


def test_a_fine_tuning_load_with_a_new_head_is_silent() -> None:
    torch.manual_seed(0)
    saved = Net(classes=10).state_dict()
    saved = {k: v for k, v in saved.items() if not k.startswith("head.")}
    saved["fc.weight"], saved["fc.bias"] = torch.zeros(10, 16), torch.zeros(10)  # old head
    model = Net()
    assert not _run(model, _sgd(model), _once(lambda: model.load_state_dict(saved, strict=False)))


def test_an_optimizer_built_again_after_its_scheduler() -> None:
    model = Net()
    old = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # e.g. rebuilt after unfreezing
    with pytest.warns(UserWarning, match="lr_scheduler.step"):
        (f,) = _run(model, opt, lambda k: sched.step() if k else None)
    assert f.details["kind"] == "other_optimizer" and f.details["used"] == [1e-3]


def test_a_hand_written_decay_on_a_stale_optimizer_object() -> None:
    model = Net()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def decay(k: int) -> None:
        for g in stale.param_groups:
            g["lr"] = 0.1 * 0.5**k

    (f,) = _run(model, opt, decay)
    assert f.details["kind"] == "other_optimizer"


@pytest.mark.parametrize(
    ("write", "kind"),
    [
        (lambda opt: setattr(opt, "lr", 0.01), "attribute"),
        (lambda opt: opt.defaults.__setitem__("lr", 0.01), "defaults"),
    ],
)
def test_a_learning_rate_written_where_step_does_not_read_it(write: Any, kind: str) -> None:
    model = Net()
    opt = _sgd(model)
    (f,) = _run(model, opt, _once(lambda: write(opt), at=1))
    assert f.details["kind"] == kind and f.details["written"] == 0.01
    assert f.details["used"] == [0.1]


def test_schedules_on_the_stepped_optimizer_are_silent() -> None:
    model = Net()
    opt = _sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def by_hand_too(k: int) -> None:
        if k:
            sched.step()
        if k == 2:
            for g in opt.param_groups:
                g["lr"] = 0.01
            opt.defaults["lr"] = 0.01  # and the defaults, for groups added later

    assert not _run(model, opt, by_hand_too)


def _epoch_start(first: Callable[[nn.Module], Any], then: Callable[[nn.Module], Any]) -> Any:
    model = Net()

    def before(k: int) -> None:
        if k == 0:
            first(model)
            then(model)

    return _run(model, _sgd(model), before)


def test_an_encoder_put_in_eval_then_model_train() -> None:
    (f,) = _epoch_start(lambda m: m.enc.eval(), lambda m: m.train())
    assert f.module == "enc" and f.details["kind"] == "eval" and f.details["undone_by"] == ""


def test_a_frozen_encoder_unfrozen_by_a_blanket_call() -> None:
    (f,) = _epoch_start(lambda m: m.enc.requires_grad_(False), lambda m: m.requires_grad_(True))
    assert f.module == "enc" and f.details["kind"] == "freeze"


def _partial(m: nn.Module) -> None:
    for p in m.enc[3].parameters():
        p.requires_grad = True


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (lambda m: m.eval(), lambda m: m.train()),  # validation, then back to training
        (lambda m: m.enc.eval(), lambda m: m.enc.train()),  # its own decision
        (lambda m: m.enc.requires_grad_(False), _partial),  # unfreeze the last layer by hand
        (lambda m: m.train(), lambda m: m.enc.eval()),  # the partial eval applied after
    ],
)
def test_undos_that_are_decisions_are_silent(first: Any, then: Any) -> None:
    assert not _epoch_start(first, then)


def test_a_sample_drawn_in_eval_then_restored_by_model_train_is_silent() -> None:
    model = Net()

    def sample(k: int) -> None:
        model.enc.eval()  # a preview through the encoder, dropout off
        with torch.no_grad():
            model.enc(torch.randn(2, 8))
        model.train()  # restored by the blanket call: the eval took effect

    assert not _run(model, _sgd(model), sample)


def test_gradual_unfreezing_after_steps_is_silent() -> None:
    model = Net()

    def before(k: int) -> None:
        if k == 0:
            model.enc.requires_grad_(False)
        if k == 2:
            model.requires_grad_(True)  # after two steps: the freeze took effect

    assert not _run(model, _sgd(model), before, steps=4)


def test_the_wrappers_are_gone_after_the_watch() -> None:
    model = Net()
    before = {name: getattr(nn.Module, name) for name in _WRAPPED}
    _run(model, _sgd(model), lambda k: None, steps=1)
    for name in _WRAPPED:
        fn: Optional[Any] = getattr(nn.Module, name)
        assert not getattr(fn, "_gradwatch_state", False) and fn is before[name]
    assert _loads.wrapped(nn.Module)  # load_state_dict: kept from import, for the process


_WRAPPED = ("train", "requires_grad_", "to", "half", "float", "double", "bfloat16", "cuda", "cpu")
