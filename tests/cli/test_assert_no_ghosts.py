"""``gradwatch.testing.assert_no_ghosts`` on real models and real autograd."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradwatch.cli.probe import ProbeError
from gradwatch.testing import assert_no_ghosts

pytestmark = pytest.mark.floor  # the fixture on the pytest floor (.ci/floor)


class Net(nn.Module):
    def __init__(self, *, aux: bool = False, frozen_branch: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 2) if aux else None  # defined, never called
        self.side = nn.Linear(4, 1) if frozen_branch else None
        self.frozen_branch = frozen_branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.body(x)))
        if self.side is not None:
            with torch.no_grad():  # the bug: a trainable branch run without autograd
                side = self.side(x)
            out = out + side
        return out


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


BATCH = (torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 1))


def test_clean_model_passes_and_returns_the_report() -> None:
    report = assert_no_ghosts(Net(), BATCH, mse)
    assert report.steps == 2 and report.by_check("ghost_param") == []


def test_ghost_raises_listing_names_cause_and_hint() -> None:
    with pytest.raises(AssertionError) as info:
        assert_no_ghosts(Net(aux=True), BATCH, mse, steps=3)
    text = str(info.value)
    assert text.startswith("2 trainable parameter(s) in 1 layer(s) got no gradient in 3 step(s)")
    assert "aux.weight, aux.bias" in text and "cause: not_called" in text
    assert "hint: Its module never ran" in text
    assert "body." not in text and "head." not in text


def test_no_grad_cause_is_named() -> None:
    with pytest.raises(
        AssertionError, match=r"(?s)side\.weight.*cause: no_grad.*hint: .*torch\.no_grad"
    ):
        assert_no_ghosts(Net(frozen_branch=True), BATCH, mse)


@pytest.mark.parametrize(
    "kwargs", [{"ignore": ["aux.*"]}, {"config": {"ignore": ["aux.weight", "aux.bias"]}}]
)
def test_allowlisted_ghost_passes(kwargs: dict) -> None:
    assert_no_ghosts(Net(aux=True), BATCH, mse, **kwargs)


def test_batches_from_an_iterator_and_own_optimizer() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]
    model = Net()
    before = model.head.weight.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    report = assert_no_ghosts(model, iter(batches), mse, optimizer=opt, steps=3)
    assert report.steps == 3 and not torch.equal(before, model.head.weight)


def test_no_warnings_even_when_warnings_are_errors() -> None:
    # The AssertionError is the channel: a GradWatchWarning turned into an error mid-step
    # would hide it behind a less useful exception.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AssertionError, match=r"aux\.weight"):
            assert_no_ghosts(Net(aux=True), BATCH, mse)


def test_failing_loss_fn_names_the_step() -> None:
    def bad(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(batch[0][:, :3]), batch[1])

    with pytest.raises(ProbeError, match="loss_fn failed at step 0: RuntimeError") as info:
        assert_no_ghosts(Net(), BATCH, bad)
    assert isinstance(info.value.__cause__, RuntimeError)
