"""Awkward models and loops: no crash, and the findings a person would expect."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

import gradwatch

Loop = Callable[[], torch.Tensor]


def train(
    model: nn.Module,
    opt: Optional[torch.optim.Optimizer],
    loss_fn: Loop,
    steps: int = 4,
    config: Optional[dict[str, Any]] = None,
    between: Optional[Callable[[int], None]] = None,
) -> gradwatch.Report:
    """An ordinary loop under ``watch()`` (strict about gradwatch's own faults)."""
    cfg = {"every_n_steps": 1, "on_internal_error": "raise", **(config or {})}
    with gradwatch.watch(model, opt, config=cfg) as w:
        for s in range(steps):
            if between is not None:
                between(s)
            if opt is not None:
                opt.zero_grad()
            loss_fn().backward()
            if opt is not None:
                opt.step()
    report = w.report()
    assert not report.by_check("internal_error")
    return report


def checks(report: gradwatch.Report) -> dict[str, list[str]]:
    """check id -> sorted parameter names of its findings."""
    out: dict[str, list[str]] = {}
    for f in report.findings:
        out.setdefault(f.check, []).extend(f.params)
    return {k: sorted(v) for k, v in out.items()}


def layer(report: gradwatch.Report, name: str) -> gradwatch.LayerStats:
    return next(layer for layer in report.layers if layer.name == name)


# -- lazy modules ----------------------------------------------------------------------------


def test_lazy_module_attached_before_its_first_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = train(model, opt, lambda: model(torch.randn(4, 5)).pow(2).mean())
    assert checks(report) == {}
    lazy = layer(report, "0")
    assert lazy.numel == 5 * 8 + 8
    assert lazy.grad_norm_last is not None and lazy.grad_norm_last > 0
    assert lazy.steps_with_grad >= 3  # tracked from the first step after materialisation


def test_lazy_module_in_a_dead_branch_is_a_ghost_after_its_sibling_materialises() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.LazyLinear(3), "branch": nn.LazyLinear(3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss() -> torch.Tensor:
        x = torch.randn(2, 4)
        return model["used"](x).sum() + model["branch"](x).detach().sum()

    report = train(model, opt, loss)
    assert checks(report) == {"ghost_param": ["branch.bias", "branch.weight"]}
    (ghost,) = report.by_check("ghost_param")
    assert ghost.details["cause"] == "disconnected"


def test_lazy_module_never_called_is_a_ghost() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(4, 3), "never": nn.LazyLinear(3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = train(model, opt, lambda: model["used"](torch.randn(2, 4)).sum())
    assert checks(report) == {"ghost_param": ["never.bias", "never.weight"]}


# -- parameters added or replaced after attaching --------------------------------------------


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.extra is not None:
            h = self.extra(h)
        return h.pow(2).mean()


def test_layer_added_and_given_to_the_optimizer_is_tracked_from_the_next_step() -> None:
    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def grow(step: int) -> None:
        if step == 2:
            model.extra = nn.Linear(4, 4)
            opt.add_param_group({"params": list(model.extra.parameters())})

    report = train(model, opt, lambda: model(torch.randn(3, 4)), steps=6, between=grow)
    assert checks(report) == {}
    extra = layer(report, "extra")
    assert extra.in_optimizer and extra.trainable
    assert extra.grad_norm_last is not None
    # judged from the step after it was first seen (steps 3..5 of 0..5); never missing
    assert extra.steps_without_grad == 0
    assert 3 <= extra.steps_with_grad <= 4


def test_layer_added_but_not_given_to_the_optimizer_is_not_in_optimizer() -> None:
    torch.manual_seed(0)
    model = Growing()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def grow(step: int) -> None:
        if step == 2:
            model.extra = nn.Linear(4, 4)

    report = train(model, opt, lambda: model(torch.randn(3, 4)), steps=5, between=grow)
    assert checks(report) == {"not_in_optimizer": ["extra.bias", "extra.weight"]}
    assert report.by_check("not_in_optimizer")[0].first_step >= 2


def test_parameter_replaced_after_attaching_is_reported() -> None:
    """``layer.weight = nn.Parameter(...)`` after the optimizer was built: the new tensor is in
    no optimizer, and the optimizer keeps updating the old one that no longer gets gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def replace(step: int) -> None:
        if step == 2:
            model[0].weight = nn.Parameter(torch.randn(4, 4))

    report = train(model, opt, lambda: model(torch.randn(3, 4)).pow(2).mean(), 5, between=replace)
    found = checks(report)
    assert found["not_in_optimizer"] == ["0.weight"]
    assert found["ghost_param"] == ["0.weight"]  # the stale tensor still in the optimizer
    assert set(found) == {"not_in_optimizer", "ghost_param"}


# -- dtype, complex, meta --------------------------------------------------------------------


def test_model_moved_to_float64_after_attaching() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    # stateless SGD: Adam's float32 moments would not follow the move (a torch matter)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dtype = [torch.float32]

    def to64(step: int) -> None:
        if step == 2:
            model.to(torch.float64)
            dtype[0] = torch.float64

    def loss() -> torch.Tensor:
        return model(torch.randn(3, 4, dtype=dtype[0])).pow(2).mean()

    report = train(model, opt, loss, steps=5, between=to64)
    assert checks(report) == {}
    assert model[0].weight.dtype == torch.float64
    for name in ("0", "2"):
        stats = layer(report, name)
        assert stats.steps_with_grad == 5
        assert stats.update_ratio is not None and stats.update_ratio > 0


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))
        self.unused = nn.Parameter(torch.randn(4, dtype=torch.cfloat))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.cfloat) @ self.w).abs()).pow(2).mean()


def test_complex_valued_parameters() -> None:
    torch.manual_seed(0)
    model = ComplexNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    report = train(model, opt, lambda: model(torch.randn(3, 4)))
    assert checks(report) == {"ghost_param": ["unused"]}
    root = layer(report, "(root)")
    assert root.grad_norm_last is not None and root.grad_norm_last > 0
    assert root.update_ratio is not None and root.update_ratio > 0


def test_complex_nan_gradient_is_found() -> None:
    torch.manual_seed(0)
    model = ComplexNet()
    opt = torch.optim.SGD([model.w, *model.head.parameters()], lr=0.01)

    def loss() -> torch.Tensor:
        return model(torch.randn(3, 4)) * torch.tensor(float("nan"))

    report = train(model, opt, loss, steps=2)
    assert "nonfinite_grad" in checks(report)


def test_parameters_on_meta_device_are_a_clear_error() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(gradwatch.ConfigError, match=r"'0\.weight' is on the meta device") as err:
        with gradwatch.watch(model):
            pass
    assert "\n" not in str(err.value)
    assert "to_empty" in str(err.value)


# -- wrappers and functional calls -------------------------------------------------------------


class WithGhost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.ghost = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_dataparallel_on_cpu_is_unwrapped() -> None:
    torch.manual_seed(0)
    model = nn.DataParallel(WithGhost())  # on CPU it just calls its module
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = train(model, opt, lambda: model(torch.randn(3, 4)).pow(2).mean())
    # names are the user's module's names, without DataParallel's "module." prefix
    assert checks(report) == {"ghost_param": ["ghost.bias", "ghost.weight"]}
    assert report.by_check("ghost_param")[0].details["cause"] == "not_called"
    assert layer(report, "a").steps_with_grad == 4


def test_functional_call_with_the_models_own_parameters() -> None:
    """``torch.func.functional_call``: handled when the tensors it is given are the model's own
    parameters or functions of them (fast weights, as in MAML): gradients still reach the
    watched parameters, so ghosts and statistics are right. Documented limitation: tensors
    that are unrelated to the model's parameters (e.g. detached copies) are not watched, and
    the parameters they stand in for are reported as ghosts (cause ``disconnected``), which is
    true of the watched parameters."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 1), "ghost": nn.Linear(4, 4)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = torch.func.functional_call(model["a"], params_of(params, "a"), (x,))
        return torch.func.functional_call(model["b"], params_of(params, "b"), (h,)).pow(2).mean()

    def params_of(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) + 1 :]: v for k, v in params.items() if k.startswith(prefix + ".")}

    own = train(model, opt, lambda: forward(dict(model.named_parameters()), torch.randn(3, 4)))
    assert checks(own) == {"ghost_param": ["ghost.bias", "ghost.weight"]}
    assert own.by_check("ghost_param")[0].details["cause"] == "not_called"

    fast = train(
        model,
        opt,
        lambda: forward({k: p * 0.9 for k, p in model.named_parameters()}, torch.randn(3, 4)),
    )
    assert checks(fast) == {"ghost_param": ["ghost.bias", "ghost.weight"]}

    def detached() -> torch.Tensor:
        params = dict(model.named_parameters())
        params["a.weight"] = params["a.weight"].detach().clone().requires_grad_()
        return forward(params, torch.randn(3, 4))

    swapped = train(model, opt, detached)
    assert checks(swapped) == {"ghost_param": ["a.weight", "ghost.bias", "ghost.weight"]}
    causes = {f.module: f.details["cause"] for f in swapped.by_check("ghost_param")}
    assert causes == {"a": "disconnected", "ghost": "not_called"}


# -- watchers ----------------------------------------------------------------------------------


def test_two_watchers_on_one_model_are_refused_clearly() -> None:
    model = nn.Linear(2, 2)
    with gradwatch.watch(model) as first:
        second = gradwatch.watch(model)
        with pytest.raises(gradwatch.GradWatchError, match="already watched") as err:
            second.attach()
        assert "\n" not in str(err.value)
        model(torch.randn(1, 2)).sum().backward()
    assert first.report().backward_passes == 1
    # the refused watcher hooked nothing; once the first exits a new one may watch
    assert not model.weight._post_accumulate_grad_hooks
    with gradwatch.watch(model) as third:
        model(torch.randn(1, 2)).sum().backward()
    assert third.report().backward_passes == 1


def test_two_watchers_through_a_wrapper_are_refused() -> None:
    model = nn.Linear(2, 2)
    with gradwatch.watch(model), pytest.raises(gradwatch.GradWatchError, match="already watched"):
        with gradwatch.watch(nn.DataParallel(model)):
            pass


def test_watching_the_same_model_again_after_exit_starts_fresh() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 1), "b": nn.Linear(4, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = train(model, opt, lambda: model["a"](torch.randn(2, 4)).sum(), steps=3)
    assert checks(first) == {"ghost_param": ["b.bias", "b.weight"]}
    second = train(
        model,
        opt,
        lambda: (model["a"](torch.randn(2, 4)) + model["b"](torch.randn(2, 4))).sum(),
        steps=2,
    )
    assert checks(second) == {}
    assert second.steps == 2
    assert first.steps == 3


def test_reentering_a_closed_watcher_is_refused() -> None:
    model = nn.Linear(2, 2)
    w = gradwatch.watch(model)
    with w:
        pass
    with pytest.raises(gradwatch.GradWatchError, match="closed"), w:
        pass
    assert not model.weight._post_accumulate_grad_hooks


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="core: ParamIndex and the per-parameter hooks hold weakref.ref(param); "
    "torch.utils.swap_tensors refuses tensors with weak references, so with "
    "torch.__future__.set_swap_module_params_on_conversion(True) (and for traceable tensor "
    "subclasses such as DTensor, which always swap) model.to()/.float()/.cuda() raises "
    '"_apply(): Couldn\'t swap Linear.weight" while watched',
)
def test_model_moved_after_attaching_with_swap_on_conversion() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with gradwatch.watch(model, opt):
            model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert model[0].weight.dtype == torch.float64


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_validation_through_nested_tensors_between_steps() -> None:
    """``nn.TransformerEncoder`` in eval under ``no_grad`` with a padding mask runs on nested
    tensors (its fast path); the NaN probe's forward hooks must pass them by, not fail."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2)
    model = nn.ModuleDict({"emb": nn.Embedding(50, 16, padding_idx=0), "enc": enc})
    x = torch.randint(1, 50, (4, 12))
    x[:, 9:] = 0

    def forward() -> torch.Tensor:
        return model["enc"](model["emb"](x), src_key_padding_mask=x == 0)

    nested: list[bool] = []
    enc.layers[0].register_forward_hook(lambda m, args, out: nested.append(out.is_nested))

    def validate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            forward()
        model.train()

    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    report = train(model, opt, lambda: forward().pow(2).mean(), steps=6, between=validate)
    assert True in nested  # the fast path really ran
    assert not report.failed, [f.line() for f in report.findings]
