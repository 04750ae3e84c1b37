"""``call_without_effect``: a dtype or device asked of a sub-module, undone before the step.

Violating forms, as practitioners report them: a norm layer or head kept in fp32
(``model.norm.float()``) and then ``model.half()`` or ``model.to(torch.bfloat16)`` for
mixed precision by hand, which casts it back; ``sub.double()`` for a numerically sensitive
block, then ``model.float()``; ``model.enc.to(torch.float64)`` undone by a later
``model.to(torch.float32)``. The device form (``model.encoder.to('cpu')`` then
``model.to(device)``) runs the same path; here on CPU only its parsing is exercised. Clean
twins: the exceptions applied after the blanket cast (``model.half()`` then
``model.norm.float()``), a head cast and trained before the model is cast, moves of the whole
model, a module moved back by its own call, a blanket move that leaves it as asked.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from test_call_without_effect import _run as run_loop
from torch import nn

from gradwatch.capture.loop import moves

ID = "call_without_effect"


def _dtype(m: nn.Module) -> torch.dtype:
    return next(m.parameters()).dtype


class Mixed(nn.Module):
    """Casts each part's input to that part's dtype, as hand-written mixed precision does."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x.to(_dtype(self.enc)))
        h = self.norm(h.to(_dtype(self.norm)))
        return self.head(h.to(_dtype(self.head))).float()


def _run(model: nn.Module, before: Callable[[int], None], steps: int = 3) -> list[Any]:
    return run_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), before, steps)


def _first(*calls: Callable[[Mixed], Any]) -> list[Any]:
    model = Mixed()

    def before(k: int) -> None:
        if k == 0:
            for call in calls:
                call(model)

    return _run(model, before)


@pytest.mark.parametrize(
    ("keep", "cast", "module", "wanted", "at_step"),
    [  # a part kept in fp32, then the blanket cast to half precision
        (lambda m: m.norm.float(), lambda m: m.half(), "norm", torch.float32, torch.float16),
        (
            lambda m: m.head.float(),
            lambda m: m.to(torch.bfloat16),
            "head",
            torch.float32,
            torch.bfloat16,
        ),
        # a block in fp64, then the model back to fp32
        (lambda m: m.head.double(), lambda m: m.float(), "head", torch.float64, torch.float32),
        (
            lambda m: m.enc.to(torch.float64),
            lambda m: m.to(dtype=torch.float32),
            "enc",
            torch.float64,
            torch.float32,
        ),
        # a partial cast of one block, then `.bfloat16()` of the whole
        (
            lambda m: m.enc[2].double(),
            lambda m: m.bfloat16(),
            "enc.2",
            torch.float64,
            torch.bfloat16,
        ),
    ],
)
def test_a_cast_of_a_part_undone_by_a_blanket_cast(
    keep: Any, cast: Any, module: str, wanted: torch.dtype, at_step: torch.dtype
) -> None:
    (f,) = _first(keep, cast)
    assert f.severity == "warning" and f.module == module
    assert f.details["kind"] == "dtype" and f.details["undone_by"] == ""
    assert f.details["wanted"] == str(wanted) and f.details["at_step"] == [str(at_step)]
    assert "test_call_without_effect_moves.py" in f.details["called_at"]
    assert all(p.startswith(module + ".") for p in f.params)
    assert "was undone before the step" in f.message


def test_an_intermediate_block_undoing_a_cast_is_named() -> None:
    (f,) = _first(lambda m: m.enc[0].double(), lambda m: m.enc.float())
    assert f.module == "enc.0" and f.details["undone_by"] == "enc"
    assert "float() on 'enc'" in f.message


@pytest.mark.parametrize(
    "calls",
    [
        (lambda m: m.half(), lambda m: m.norm.float()),  # the exceptions after the blanket cast
        (lambda m: m.double(), lambda m: m.float()),  # the whole model, twice
        (lambda m: m.head.double(), lambda m: m.head.float()),  # moved back by its own call
        (lambda m: m.head.float(), lambda m: m.to("cpu")),  # a device move leaves the dtype
        (lambda m: m.head.float(), lambda m: m.float()),  # the blanket call agrees
        (lambda m: m.head.double(), lambda m: m.enc.float()),  # not an ancestor of the head
        (lambda m: m.head.to(memory_format=torch.preserve_format), lambda m: m.half()),
    ],
)
def test_moves_that_are_decisions_are_silent(calls: Any) -> None:
    assert not _first(*calls)


def test_a_part_cast_and_trained_before_the_model_is_cast_is_silent() -> None:
    model = Mixed()

    def before(k: int) -> None:
        if k == 0:
            model.head.double()  # the head trains in fp64 for two steps
        if k == 2:
            model.float()  # then the whole model in fp32: the fp64 head took effect

    assert not _run(model, before, steps=4)


def test_a_cast_each_forward_holds_one_intent() -> None:
    class CastsInForward(Mixed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.norm.float()  # e.g. a library keeping its norm in fp32 on every call
            return super().forward(x)

    model = CastsInForward()
    assert not _run(model, lambda k: None)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_eval_and_freeze_of_one_module_are_both_followed() -> None:
    model = Mixed()

    def before(k: int) -> None:
        if k == 0:
            model.enc.eval()
            model.enc.requires_grad_(False)
            model.train()
            model.requires_grad_(True)

    found = _run(model, before)
    assert sorted(f.details["kind"] for f in found) == ["eval", "freeze"]


def test_a_fault_in_the_wrapper_never_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any) -> Any:
        raise RuntimeError("gradwatch bug")

    monkeypatch.setattr(moves, "wants", broken)
    model = Mixed()

    def before(k: int) -> None:
        if k == 0:
            assert model.head.double() is model.head
            assert model.float() is model

    assert not _run(model, before)
    assert _dtype(model.head) == torch.float32


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "want"),
    [
        ("cuda", (), {}, {"device": torch.device("cuda")}),
        ("cuda", (1,), {}, {"device": torch.device("cuda", 1)}),
        ("cpu", (), {}, {"device": torch.device("cpu")}),
        ("to", ("cuda:0",), {}, {"device": torch.device("cuda", 0)}),
        (
            "to",
            (torch.device("cpu"), torch.float16),
            {},
            {"dtype": torch.float16, "device": torch.device("cpu")},
        ),
        ("to", (), {"dtype": torch.bfloat16}, {"dtype": torch.bfloat16}),
        (
            "to",
            (torch.zeros(1, dtype=torch.float64),),
            {},
            {"dtype": torch.float64, "device": torch.device("cpu")},
        ),
        ("to", (), {"memory_format": torch.channels_last}, {}),
    ],
)
def test_what_a_move_asks(method: str, args: Any, kwargs: Any, want: dict[str, Any]) -> None:
    assert moves.wants(method, args, kwargs) == want


def test_a_device_asked_is_held_by_type_and_index() -> None:
    head = nn.Linear(2, 2)
    assert moves.holds(head, "device", torch.device("cpu"))
    assert not moves.holds(head, "device", torch.device("cuda"))
    assert moves.state_of(head, "device") == ["cpu"]
    assert moves.holds(nn.ReLU(), "dtype", torch.float16)  # nothing to hold: never undone
