"""gradwatch.sensitivity against analytic Hessians, its errors, and ``check --curvature``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

import gradwatch
from gradwatch.cli.main import main
from gradwatch.report import Curvature, Report
from gradwatch.vectors.sensitivity import SensitivityError, sensitivity

ROOT = Path(__file__).resolve().parents[2]
CLEAN = str(ROOT / "examples" / "ci_clean.py") + ":build"


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


# --- linear least squares: H = (2/N) [X 1]^T [X 1] ---------------------------------------
def least_squares(n: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64) * torch.tensor(
        [1.0, 2.0, 3.0, 0.5, 1.0], dtype=torch.float64
    )
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    model = nn.Linear(5, 1).double()
    a = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1)
    return model, (x, y), 2.0 / n * a.T @ a


def test_least_squares_trace_and_top_eigenvalue_match_the_closed_form() -> None:
    model, batch, hess = least_squares()
    curv = sensitivity(model, batch, mse, samples=64, power_iters=100, tol=1e-10)
    (row,) = curv.layers
    assert row.name == "(root)" and row.params == ["weight", "bias"] and row.numel == 6
    truth = float(hess.trace())
    assert 0 < row.trace_stderr < 0.05 * truth
    assert abs(row.trace - truth) < 3 * row.trace_stderr
    assert row.trace_per_param == pytest.approx(row.trace / 6)
    assert row.top_eigenvalue == pytest.approx(float(torch.linalg.eigvalsh(hess)[-1]), rel=1e-6)
    assert curv.hvps == 64 + row.power_iters
    assert model.weight.grad is None  # .grad is not touched
    assert curv.loss == pytest.approx(float(mse(model, batch).detach()))


def test_reported_standard_error_is_honest_over_many_seeds() -> None:
    model, batch, hess = least_squares()
    truth = float(hess.trace())
    within = [
        abs(row.trace - truth) <= 2 * row.trace_stderr
        for row in (
            sensitivity(model, batch, mse, samples=32, power_iters=1, seed=s).layers[0]
            for s in range(40)
        )
    ]
    # 95 % of t(31) lies within 2 standard errors; 32 of 40 fails with probability < 1e-3.
    assert sum(within) >= 32, sum(within)


# --- two layers whose curvatures differ 100x: W2 (W1 x) ----------------------------------
class DeepLinear(nn.Module):
    def __init__(self, d: int = 6, h: int = 5, o: int = 3) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.first = nn.Linear(d, h, bias=False).double()
        self.second = nn.Linear(h, o, bias=False).double()
        with torch.no_grad():
            self.first.weight.copy_(torch.randn(h, d, generator=g, dtype=torch.float64) * 1.5)
            self.second.weight.copy_(torch.randn(o, h, generator=g, dtype=torch.float64) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def deep_linear_blocks(model: DeepLinear, x: torch.Tensor, out: int) -> dict[str, torch.Tensor]:
    """The diagonal Hessian blocks of mean squared error, in closed form.

    The output is linear in each weight, so each block is its Gauss-Newton term:
    d2L/dW1^2 = c (W2^T W2) kron (X^T X) and d2L/dW2^2 = c I kron (H^T H), H = X W1^T,
    c = 2 / (N * out) (``mse_loss`` averages over every output element), row-major vec.
    """
    c = 2.0 / (x.shape[0] * out)
    w1, w2 = model.first.weight.detach(), model.second.weight.detach()
    h = x @ w1.T
    return {
        "first": c * torch.kron(w2.T @ w2, x.T @ x),
        "second": c * torch.kron(torch.eye(out, dtype=torch.float64), h.T @ h),
    }


def test_two_layers_100x_apart_are_ranked_right_and_each_is_accurate() -> None:
    model = DeepLinear()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y = torch.randn(40, 3, generator=g, dtype=torch.float64)
    blocks = deep_linear_blocks(model, x, 3)
    # The closed form is the Hessian autograd computes (a check of the test itself).
    full = torch.autograd.functional.hessian(
        lambda w: F.mse_loss(x @ w.T @ model.second.weight.detach().T, y),
        model.first.weight.detach(),
    ).reshape(30, 30)
    torch.testing.assert_close(full, blocks["first"])
    per = {k: float(b.trace()) / b.shape[0] for k, b in blocks.items()}
    assert 60 < per["second"] / per["first"] < 200  # about 100x apart

    curv = sensitivity(model, (x, y), mse, samples=48, power_iters=200, tol=1e-9)
    rows = {c.name: c for c in curv.layers}
    assert [c.name for c in curv.ranked()] == ["second", "first"]
    for name, block in blocks.items():
        row, truth = rows[name], float(block.trace())
        assert abs(row.trace - truth) < 3 * row.trace_stderr, (name, row.trace, truth)
        # Per-layer probes: the small layer's error bar is its own, not the big layer's.
        assert row.trace_stderr < 0.1 * truth, (name, row.trace_stderr, truth)
        assert row.top_eigenvalue == pytest.approx(
            float(torch.linalg.eigvalsh(block)[-1]), rel=1e-4
        )


def test_layer_estimate_does_not_depend_on_the_other_layers() -> None:
    model = DeepLinear()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    both = sensitivity(model, (x, y), mse, samples=4, seed=3)
    alone = sensitivity(model, (x, y), mse, samples=4, seed=3, layers="first")
    assert [c.name for c in alone.layers] == ["first"]
    assert alone.layers[0] == both.layers[0]
    assert sensitivity(model, (x, y), mse, samples=4, seed=4).layers[0] != both.layers[0]


def test_nonlinear_block_matches_autograd_hessian() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    w, b = model[0].weight.detach(), model[0].bias.detach()

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ flat[:12].reshape(4, 3).T + flat[12:])
        return F.mse_loss(model[2](h), y)

    block = torch.autograd.functional.hessian(loss_of, torch.cat([w.reshape(-1), b]))
    eig = torch.linalg.eigvalsh(block)
    top = float(eig[eig.abs().argmax()])
    row = sensitivity(model, (x, y), mse, samples=64, power_iters=300, tol=1e-10).layers[0]
    assert abs(row.trace - float(block.trace())) < 3 * row.trace_stderr + 1e-9
    assert row.top_eigenvalue == pytest.approx(top, rel=1e-3)


# --- errors ------------------------------------------------------------------------------
class _OnceDifferentiableSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class NoDoubleBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OnceDifferentiableSquare.apply(self.fc(x))


def test_double_backward_unsupported_is_one_line_naming_the_layer() -> None:
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    with pytest.raises(SensitivityError) as info:
        sensitivity(NoDoubleBackward(), batch, mse, samples=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("sensitivity needs double backward")
    assert "'fc'" in message and "once_differentiable" in message


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum(1)


def test_fused_cpu_attention_is_refused_and_the_math_kernel_works() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = Attention()
    batch = (torch.randn(2, 5, 8), torch.randn(2, 5, 4))
    with pytest.raises(SensitivityError, match=r"layer 'qkv' failed: .*not implemented"):
        sensitivity(model, batch, mse, samples=2)

    def math_mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return mse(m, b)

    assert sensitivity(model, batch, math_mse, samples=2).layers[0].name == "qkv"


def test_bad_inputs_are_one_line_errors() -> None:
    model = nn.Linear(3, 1)
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    with pytest.raises(SensitivityError, match="samples must be an int of at least 2"):
        sensitivity(model, batch, mse, samples=1)
    with pytest.raises(SensitivityError, match="does not require grad"):
        sensitivity(model, batch, lambda m, b: mse(m, b).detach())
    with pytest.raises(SensitivityError, match=r"scalar tensor, got shape \(4, 1\)"):
        sensitivity(model, batch, lambda m, b: m(b[0]))
    with pytest.raises(SensitivityError, match=r"loss_fn failed: IndexError"):
        sensitivity(model, batch, lambda m, b: b[5])
    with pytest.raises(SensitivityError, match=r"layers \['head'\] match no layer"):
        sensitivity(model, batch, mse, layers=["head"])
    assert isinstance(SensitivityError("x"), gradwatch.ConfigError)


def test_loss_linear_in_a_layer_has_zero_curvature_there() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(6, 3)
    # The loss is linear in the last bias: its gradient does not depend on any parameter.
    curv = sensitivity(
        model, (x, None), lambda m, b: m(b[0]).sum() + m[0](b[0]).pow(2).sum(), samples=4
    )
    rows = {c.name: c for c in curv.layers}
    assert rows["1"].trace == 0.0 and rows["1"].top_eigenvalue == 0.0
    assert rows["0"].trace > 0


def test_public_export_and_json_round_trip() -> None:
    model, batch, _ = least_squares()
    curv = gradwatch.sensitivity(model, batch, mse, samples=4)
    assert isinstance(curv, gradwatch.Curvature)
    assert Curvature.model_validate_json(curv.model_dump_json()) == curv
    assert "(root)" in curv.table()


# --- CLI and HTML ------------------------------------------------------------------------
@pytest.mark.floor  # the CLI and the HTML (matplotlib)
def test_check_curvature_adds_it_to_the_report_and_the_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert (
        main(["check", CLEAN, "--curvature", "--curvature-samples", "4", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    assert "per param" in printed and "encoder.0" in printed
    report = Report.model_validate(json.loads(out.read_text()))
    assert report.curvature is not None
    assert [c.name for c in report.curvature.layers] == ["encoder.0", "head"]
    assert report.curvature.samples == 4
    html = tmp_path / "report.html"
    assert main(["report", str(out), "--html", str(html)]) == 0
    page = html.read_text()
    assert '<h2>Curvature</h2><div class="chart-box"><img' in page  # drawn, not "chart failed"
    # Without --curvature, no section and no field.
    plain = tmp_path / "plain.json"
    assert main(["check", CLEAN, "--json", str(plain)]) == 0
    assert Report.read(plain).curvature is None


@pytest.mark.floor  # the CLI
def test_check_curvature_refuses_a_model_without_double_backward(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "once.py"
    target.write_text(
        "import torch\nimport gradwatch\nfrom torch.nn import functional as F\n"
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_sensitivity import NoDoubleBackward\n"
        "def build():\n"
        "    return gradwatch.Probe(NoDoubleBackward(), (torch.randn(4, 3), torch.randn(4, 1)),\n"
        "                           lambda m, b: F.mse_loss(m(b[0]), b[1]))\n"
    )
    assert main(["check", f"{target}:build", "--curvature"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "gradwatch: error: sensitivity needs double backward"
    )


@pytest.mark.slow  # a subprocess importing torch, two models: ~20 s
def test_benchmark_quick_reports_both_models(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "sens.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sensitivity.py"), "--quick", "--rounds", "1"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for row in data["models"].values():
        assert row["hvp_per_s"] > 0 and row["backward_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["hvp_per_s"] / row["backward_per_s"])
