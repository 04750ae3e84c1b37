"""``Watcher.add_optimizer``: an optimizer that a trainer builds after watching began.

A minGPT-style ``Trainer`` (its ``run()`` builds the optimizer from the model's
``configure_optimizers`` and calls ``on_batch_end`` callbacks) is watched from outside: the
optimizer is attached from the first ``on_batch_end``. Correct: silent, no ``not_observed``
or ``not_in_optimizer`` for the steps before it was attached. Bugs after it: a module left
out of ``configure_optimizers`` (coverage judged from then on), a forgotten ``zero_grad``.
Also: attached before the loop or between a backward and its step, named with named models,
its hooks removed on exit, and a clear error after exit.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import pytest
import torch
from _loops import fired
from test_cleanup import hook_state
from torch import nn

import gradwatch
from gradwatch.checks.coverage import NotInOptimizer
from gradwatch.checks.zero_grad import MissingZeroGrad
from gradwatch.errors import ConfigError, GradWatchError

CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise", "console": False}
VOCAB, BLOCK = 16, 8


class TinyGPT(nn.Module):
    """minGPT's shape in miniature: token and position embeddings, a block, an lm head."""

    def __init__(self, forget_head: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.wpe = nn.Embedding(BLOCK, 16)
        self.ln = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        self.forget_head = forget_head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.mlp(self.ln(x))
        logits = self.lm_head(x)
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, lr: float) -> torch.optim.AdamW:
        """Weight decay on the matrices only, as minGPT's GPT.configure_optimizers."""
        decay, no_decay = [], []
        for mn, m in self.named_modules():
            if self.forget_head and mn == "lm_head":
                continue  # the bug: the head is in no group
            for pn, p in m.named_parameters(recurse=False):
                (decay if pn == "weight" and isinstance(m, nn.Linear) else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class Trainer:
    """minGPT's Trainer: the optimizer is built inside ``run()``."""

    def __init__(self, model: TinyGPT, max_iters: int = 8, zero_grad: bool = True) -> None:
        self.model = model
        self.max_iters = max_iters
        self.zero_grad = zero_grad
        self.callbacks: dict[str, list[Callable[[Trainer], None]]] = defaultdict(list)
        self.optimizer: Any = None
        self.iter_num = 0

    def add_callback(self, onevent: str, callback: Callable[[Trainer], None]) -> None:
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent: str) -> None:
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self) -> None:
        model = self.model
        self.optimizer = model.configure_optimizers(lr=5e-4)
        gen = torch.Generator().manual_seed(0)
        model.train()
        while True:
            x = torch.randint(0, VOCAB, (4, BLOCK), generator=gen)
            _, self.loss = model(x, torch.roll(x, -1, dims=1))
            if self.zero_grad:
                model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            if self.iter_num >= self.max_iters:
                break


def watched_trainer(**kw: Any) -> tuple[gradwatch.Watcher, Trainer]:
    torch.manual_seed(0)
    trainer = Trainer(TinyGPT(forget_head=kw.pop("forget_head", False)), **kw)
    with gradwatch.watch(trainer.model, config=CFG) as watcher:
        trainer.add_callback("on_batch_end", lambda t: watcher.add_optimizer(t.optimizer))
        trainer.run()
    return watcher, trainer


def test_a_mingpt_trainer_attached_from_its_first_callback_is_silent() -> None:
    watcher, trainer = watched_trainer()
    report = watcher.report()
    assert not fired(report, "info"), report.findings
    assert report.coverage.optimizers == 1 and report.coverage.not_in_optimizer == 0
    assert report.steps == trainer.max_iters
    assert report.coverage.in_optimizer == report.coverage.trainable


def test_a_module_left_out_of_the_late_optimizer_is_found() -> None:
    watcher, _ = watched_trainer(forget_head=True)
    (f,) = watcher.report().by_check(NotInOptimizer.id)
    assert f.params == ["lm_head.weight"] and f.severity == "warning"


def test_a_forgotten_zero_grad_after_the_attach_is_found() -> None:
    watcher, _ = watched_trainer(zero_grad=False)
    (f,) = watcher.report().by_check(MissingZeroGrad.id)
    assert f.severity == "error" and f.message.startswith("optimizer[0].step()")


def test_attached_before_the_loop_judges_the_first_step() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    watcher = gradwatch.watch(model, config=CFG)
    opt = model.configure_optimizers(lr=5e-4)
    assert watcher.add_optimizer(opt) == "optimizer[0]"  # before enter: hooked at attach
    x = torch.randint(0, VOCAB, (4, BLOCK))
    with watcher:
        assert watcher.add_optimizer(opt) == "optimizer[0]"  # again: nothing new
        for _ in range(2):  # zero_grad forgotten from the first step on
            model(x, x)[1].backward()
            opt.step()
    (f,) = watcher.report().by_check(MissingZeroGrad.id)
    assert f.first_step == 1  # the second step already: the first one was judged


def test_attached_between_a_backward_and_its_step_is_silent() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = model.configure_optimizers(lr=5e-4)
    x = torch.randint(0, VOCAB, (4, BLOCK))
    with gradwatch.watch(model, config=CFG) as watcher:
        for k in range(6):
            opt.zero_grad()
            model(x, x)[1].backward()
            if k == 2:
                watcher.add_optimizer(opt)
            opt.step()
    assert not fired(watcher.report(), "info"), watcher.report().findings


def test_named_models_get_a_named_late_optimizer() -> None:
    g, d = nn.Linear(4, 8), nn.Linear(8, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), 0.01), torch.optim.SGD(d.parameters(), 0.01)
    with gradwatch.watch({"G": g, "D": d}, {"D": opt_d}, config=CFG) as watcher:
        with pytest.raises(ConfigError, match="optimizer 'X' names no watched model"):
            watcher.add_optimizer(opt_g, name="X")
        with pytest.raises(ConfigError, match="two optimizers are named 'D'"):
            watcher.add_optimizer(opt_g, name="D")
        assert watcher.add_optimizer(opt_g, name="G") == "optimizer['G']"
        with pytest.raises(ConfigError, match=r"watched already, as optimizer\['G'\]"):
            watcher.add_optimizer(opt_g, name="H")
        for _ in range(4):
            opt_d.zero_grad()
            opt_g.zero_grad()
            d(torch.tanh(g(torch.randn(16, 4)))).mean().backward()
            opt_d.step()  # G's step forgotten
    (f,) = [f for f in watcher.report().findings if f.details.get("cause") == "never_stepped"]
    assert f.message.startswith("optimizer['G'] never stepped") and f.params == [
        "G:weight",
        "G:bias",
    ]


def test_its_hooks_go_on_exit_and_a_closed_watcher_refuses() -> None:
    model = TinyGPT()
    opt = model.configure_optimizers(lr=5e-4)
    before = hook_state(model, opt)
    x = torch.randint(0, VOCAB, (4, BLOCK))
    with gradwatch.watch(model, config=CFG) as watcher:
        model(x, x)[1].backward()
        watcher.add_optimizer(opt)
        assert hook_state(model, opt)["optimizer pre"]  # hooked now
        opt.step()
    assert hook_state(model, opt) == before and "zero_grad" not in vars(opt)
    with pytest.raises(GradWatchError, match="closed: add_optimizer"):
        watcher.add_optimizer(opt)
    with pytest.raises(ConfigError, match="add_optimizer\\(\\)'s optimizer is a str"):
        gradwatch.watch(model).add_optimizer("adam")
