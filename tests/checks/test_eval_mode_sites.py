"""``eval_mode_training`` names the line that called ``eval()`` (issue 29).

Forms: a validation helper that never restores ``train()``, ``eval()`` once before the loop,
an inference wrapper that puts the model in eval, a sampling helper that leaves a submodule
in eval, and the same inside a Lightning ``training_step`` and an HF ``compute_loss``.
Look-alikes: helpers that restore the mode, copies and pickles of the watched model, and
``nn.Module.train`` back as it was after the run.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from _regime import DIM, EncoderDecoder, LossOf, hf_train, lightning_fit, plain_loop
from torch import nn

import gradwatch
from gradwatch.checks.eval_mode import EvalModeTraining

ID = EvalModeTraining.id
HERE = Path(__file__).name


def _line(marker: str) -> str:
    """``test_eval_mode_sites.py:N`` of the line holding ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    (n,) = [i + 1 for i, text in enumerate(lines) if text.endswith(f"# {marker}")]
    return f"{HERE}:{n}"


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
    )


def test_validation_helper_names_its_eval_line() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def validate(step: int) -> None:
        if step == 2:
            model.eval()  # validate
            with torch.no_grad():
                model(torch.randn(4, DIM))

    (f,) = plain_loop(model, opt, after_step=validate).by_check(ID)
    assert f.details["eval_called_at"].endswith(_line("validate"))
    assert f.details["last_train_step"] == 2
    assert f"was called at {f.details['eval_called_at']}, after step 2," in f.message
    assert "`train()` never after" in f.message


def test_eval_once_before_the_loop() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        model.eval()  # before-loop
        for x, y in [(torch.randn(16, DIM), torch.randn(16, 1)) for _ in range(3)]:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    (f,) = w.report().by_check(ID)
    assert f.first_step == 0 and f.details["eval_called_at"].endswith(_line("before-loop"))


def test_eval_before_watching_began_is_said_so() -> None:
    model = _mlp()
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (f,) = plain_loop(model, opt, steps=3, train_first=False).by_check(ID)
    assert f.details["eval_at_start"] is True and "eval_called_at" not in f.details


class Predictor:
    """An inference wrapper built mid-training for a demo; it puts the model in eval."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()  # predictor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)


def test_inference_wrapper_left_on() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def demo(step: int) -> None:
        if step == 1:
            Predictor(model)(torch.randn(2, DIM))

    (f,) = plain_loop(model, opt, after_step=demo).by_check(ID)
    assert f.details["eval_called_at"].endswith(_line("predictor"))


def test_sampling_helper_names_the_submodule_eval_line() -> None:
    model = EncoderDecoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def preview(step: int) -> None:
        if step == 1:
            model.decoder.eval()  # decoder-eval
            with torch.no_grad():
                model.decoder(torch.randn(1, 16))

    (f,) = plain_loop(model, opt, after_step=preview).by_check(ID)
    assert f.module == "decoder" and f.severity == "warning"
    assert f.details["eval_called_at"].endswith(_line("decoder-eval"))
    assert "`decoder.eval()` was called at" in f.message


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_training_step_names_the_eval_line(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")

    def sample(module: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            module.eval()  # lightning-sample
            with torch.no_grad():
                module(torch.randn(2, DIM))

    (f,) = lightning_fit(_mlp(), tmp_path, on_step=sample).by_check(ID)
    assert f.details["eval_called_at"].endswith(_line("lightning-sample"))


def test_hf_compute_loss_names_the_eval_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    def preview(model: nn.Module) -> None:
        model.eval()  # hf-preview
        with torch.no_grad():
            model.net(torch.randn(2, DIM))

    (f,) = hf_train(LossOf(_mlp()), tmp_path, before_loss=preview).by_check(ID)
    assert f.details["eval_called_at"].endswith(_line("hf-preview"))


# -- look-alikes ------------------------------------------------------------------------------


def test_helpers_that_restore_the_mode_are_silent() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def validate(step: int) -> None:
        was = model.training
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, DIM))
        model.train(was)
        Predictor(model)
        model.train()

    assert not plain_loop(model, opt, after_step=validate).by_check(ID)


def test_copies_of_the_watched_model_carry_nothing_and_train_is_restored() -> None:
    original = nn.Module.train
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    copies: list[nn.Module] = []

    def snapshot(step: int) -> None:
        ema = copy.deepcopy(model)  # an EMA / teacher copy, in eval: not the watched model
        ema.eval()
        pickle.loads(pickle.dumps(model)).eval()
        copies.append(ema)
        assert "train" not in vars(model) and "train" not in vars(ema)

    assert not plain_loop(model, opt, after_step=snapshot).by_check(ID)
    assert nn.Module.train is original
    assert copies[0].training is False and model.training is True
