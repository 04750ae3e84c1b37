"""Gradient health checks and statistics on real loops: exact check ids and parameter names."""

from __future__ import annotations

import math

import pytest
import torch
from _loops import batches, fired, mlp, train
from torch import nn

import gradwatch


def _deep_linear(depth: int, scale: float) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8, bias=False) for _ in range(depth)]
    with torch.no_grad():
        for layer in layers:
            nn.init.orthogonal_(layer.weight)
            layer.weight.mul_(scale)
    return nn.Sequential(*layers)


def test_exploding_twelve_layer_linear_net_scaled_by_six() -> None:
    model = _deep_linear(12, 6.0)
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2, out=8)
    exploding = report.by_check("exploding_grad")
    assert exploding, [f.line() for f in report.findings]
    assert {f.severity for f in exploding} == {"warning"}
    assert "0" in {f.module for f in exploding}  # the layer furthest from the loss is worst
    assert all(f.details["norm"] > 1e4 for f in exploding)
    assert "nonfinite_grad" not in fired(report)


def test_spike_over_running_median() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = {
        "every_n_steps": 1,
        "checks": {"exploding_grad": {"max_norm": None, "warmup": 5, "spike_factor": 20}},
    }
    with gradwatch.watch(model, opt, config=cfg) as w:
        for k, (x, y) in enumerate(batches(10)):
            opt.zero_grad()
            scale = 1e4 if k == 8 else 1.0
            (scale * nn.functional.mse_loss(model(x), y)).backward()
            opt.step()
    findings = w.report().by_check("exploding_grad")
    assert findings and {f.first_step for f in findings} == {8}
    assert "running median" in findings[0].message


def test_vanishing_at_the_first_layer_of_a_25_layer_sigmoid_mlp() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(25):
        layers += [nn.Linear(8, 8), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(8, 1))
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=4)
    vanishing = {f.module: f for f in report.by_check("vanishing_grad")}
    assert "0" in vanishing
    assert vanishing["0"].params == ["0.weight", "0.bias"]
    assert "48" not in vanishing  # the last layers still learn
    assert vanishing["0"].first_step == 2  # patience: 3 observed steps
    assert "dead_param" not in fired(report)


def test_dead_relu_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )
    with torch.no_grad():
        model[2].bias.fill_(-100.0)  # every unit of the second layer is negative: dead ReLUs
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=4)
    dead = report.by_check("dead_param")
    # One cause, one finding: layer 2 is dead, and layer 0 gets nothing through it.
    (finding,) = [f for f in dead if f.severity == "warning"]
    assert finding.module == "2" and finding.details["layers"] == ["0", "2"]
    assert set(finding.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "ghost_param" not in fired(report)


def test_redundant_bias_before_batchnorm_is_info_at_most() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    assert fired(report) == set(), [f.line() for f in report.findings]


def test_stale_layer_in_a_param_group_with_lr_zero() -> None:
    model = mlp()
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}], lr=0.01
    )
    report = train(model, opt, steps=4)
    (stale,) = report.by_check("stale_param")
    assert stale.module == "0" and stale.params == ["0.weight", "0.bias"]
    # Layer 0 holds 144 of the 161 trainable elements: most of the model does not train,
    # so the finding is an error whatever stale_param's default (warning).
    assert stale.severity == "error" and stale.first_step == 2
    assert stale.details["model_share"] > 0.5 and "Most of the model" in stale.message
    assert stale.details["cause"] == "lr_zero" and "learning rate 0" in stale.message
    assert "requires_grad=False" in stale.hint


def test_stale_layer_with_a_tensor_lr_zero_names_the_cause() -> None:
    model = mlp()
    opt = torch.optim.Adam(
        [
            {"params": model[0].parameters(), "lr": torch.tensor(0.0)},
            {"params": model[2].parameters()},
        ],
        lr=torch.tensor(0.01),
    )
    (stale,) = train(model, opt, steps=4).by_check("stale_param")
    assert stale.module == "0" and stale.details["cause"] == "lr_zero"


def test_stale_layer_with_a_non_zero_lr_does_not_blame_the_lr() -> None:
    model = mlp()  # lr 1e-30: every update rounds away, yet the learning rate is not 0
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 1e-30}, {"params": model[2].parameters()}], lr=0.01
    )
    (stale,) = train(model, opt, steps=4).by_check("stale_param")
    assert stale.module == "0" and "cause" not in stale.details
    assert "learning rate is 0" not in stale.message


def test_nonfinite_origin_through_torch_where_sqrt() -> None:
    class WhereSqrt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(4, 4)
            self.gate = nn.Parameter(torch.tensor([1.0, -1.0, 2.0, 0.5]))
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.encoder(x)
            g = torch.where(self.gate > 0, torch.sqrt(self.gate), torch.zeros_like(self.gate))
            return self.head(h * g)  # finite forward, NaN gradient for `gate`

    model = WhereSqrt()
    out = model(torch.randn(2, 4))
    assert torch.isfinite(out).all()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2, dim=4)
    (finding,) = report.by_check("nonfinite_grad")
    assert finding.details["origin"] == "gate"
    assert finding.severity == "error"
    assert "torch.where" in finding.hint


def test_nonfinite_origin_is_first_in_backward_order() -> None:
    class GatedSqrt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.middle = nn.Linear(4, 4)
            self.last = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.middle(self.first(x))
            gated = torch.where(h > 100.0, torch.sqrt(h - 100.0), torch.zeros_like(h))
            return self.last(h + gated)  # finite forward; NaN gradient flows into middle, first

    report = train(GatedSqrt(), None, steps=1, dim=4)
    (finding,) = report.by_check("nonfinite_grad")
    assert finding.details["origin"] in {"middle.weight", "middle.bias"}
    assert finding.module == "middle"
    assert set(finding.params) == {"first.weight", "first.bias", "middle.weight", "middle.bias"}


def test_grad_scaler_skipped_step_is_info_not_error() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}, scaler=scaler) as w:
        for k, (x, y) in enumerate(batches(6)):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if k == 2:
                loss = loss * float("inf")  # injected overflow: the scaler must skip this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = w.report()
    assert report.skipped_steps == 1
    (finding,) = report.by_check("nonfinite_grad")
    assert finding.severity == "info" and finding.details["skipped_steps"] == 1
    assert fired(report) == set() and not report.failed
    assert report.steps == 5


def test_bf16_autocast_on_cpu_is_clean_and_has_stats() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(b[0])
        return nn.functional.mse_loss(out.float(), b[1])

    report = train(model, opt, steps=4, loss=loss)
    assert fired(report) == set()
    assert all(layer.grad_norm_last and layer.grad_norm_last > 0 for layer in report.layers)


def test_sparse_embedding_with_sparse_adam() -> None:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 8, sparse=True)
            self.head = nn.Linear(8, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids).mean(1))

    model = Bag()
    opts = [
        torch.optim.SparseAdam(list(model.embed.parameters()), lr=1e-2),
        torch.optim.Adam(model.head.parameters(), lr=1e-2),
    ]
    with gradwatch.watch(model, opts, config={"every_n_steps": 1}) as w:
        for _ in range(4):
            for o in opts:
                o.zero_grad()
            model(torch.randint(0, 100, (8, 5))).pow(2).mean().backward()
            for o in opts:
                o.step()
    report = w.report()
    assert fired(report) == set(), [f.line() for f in report.findings]
    embed = next(layer for layer in report.layers if layer.name == "embed")
    assert embed.grad_norm_last is not None and embed.grad_norm_last > 0
    assert embed.update_ratio is not None and embed.update_ratio > 0


def test_layer_statistics_match_a_direct_computation() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "history": 3}) as w:
        before = [p.detach().clone() for p in model[0].parameters()]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in model[0].parameters()]
        opt.step()
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    layer = next(layer for layer in w.report().layers if layer.name == "0")
    norm0 = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    assert layer.history[0] == (0, pytest.approx(norm0, rel=1e-5)) or len(layer.history) == 3
    assert len(layer.history) == 3  # bounded
    assert layer.steps_with_grad == 5 and layer.steps_without_grad == 0
    assert layer.numel == 8 * 16 + 16
    assert layer.grad_norm_min <= layer.grad_norm_mean <= layer.grad_norm_max
    assert 0 < layer.update_ratio < 1
    assert layer.zero_fraction == 0.0
    assert before[0].shape == (16, 8)


def test_every_n_steps_controls_the_statistics_cadence() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = train(model, opt, steps=10, config={"every_n_steps": 4})
    layer = report.layers[0]
    assert [step for step, _ in layer.history] == [0, 4, 8]


def test_single_parameter_optimizer_is_not_stale() -> None:
    """One tensor flattens to a view of itself: the pre-step copy must be a real copy."""
    embed = nn.Embedding(10, 4)
    opt = torch.optim.SGD(embed.parameters(), lr=0.1)
    with gradwatch.watch(embed, opt, config={"every_n_steps": 1}) as w:
        for _ in range(4):
            opt.zero_grad()
            embed(torch.randint(0, 10, (6,))).pow(2).mean().backward()
            opt.step()
    report = w.report()
    assert fired(report) == set(), [f.line() for f in report.findings]
    assert report.layers[0].update_ratio is not None and report.layers[0].update_ratio > 0


class WithSideTable(nn.Module):
    """RoCBERT's form: a second embedding table (``padding_idx=0``) that text without its
    ids looks up at index 0 only; its gradient is exactly zero by torch's definition."""

    def __init__(self, padding_idx: int | None = 0) -> None:
        super().__init__()
        self.side = nn.Embedding(10, 8, padding_idx=padding_idx)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros(x.shape[0], dtype=torch.long)  # no side ids given: the padding id
        return self.body(x + self.side(ids))


def test_an_embedding_fed_only_its_padding_index_is_not_dead() -> None:
    torch.manual_seed(0)
    model = WithSideTable()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    assert "dead_param" not in fired(report), [f.line() for f in report.findings]


def test_without_a_padding_index_the_same_zero_gradient_is_still_judged() -> None:
    torch.manual_seed(0)
    model = WithSideTable(padding_idx=None)
    with torch.no_grad():
        model.side.weight[0].zero_()
    model.side.weight.register_hook(lambda g: g * 0.0)  # no gradient reaches the table
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    assert any(f.module == "side" for f in report.by_check("dead_param")), fired(report)


class ZeroedBranch(nn.Module):
    """A branch whose output the forward scales by zero: its gradient is zero from step 0
    (Longformer's last local q/k/v under a classifier that reads the global token only)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(8, 1)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + 0.0 * self.side(x)


def test_a_zero_from_the_first_step_inside_a_librarys_model_is_its_design(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gradwatch.core.structure as structure

    torch.manual_seed(0)
    model = ZeroedBranch()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    (plain,) = [f for f in report.by_check("dead_param") if f.module == "side"]
    assert plain.severity == "warning"  # the user's own model: judged as ever
    monkeypatch.setattr(structure, "library_owned", lambda m: {"side": "somelib"})
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=5)
    (found,) = [f for f in report.by_check("dead_param") if f.module == "side"]
    assert found.severity == "info" and found.details["library_design"] == "somelib"
