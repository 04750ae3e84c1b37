"""``gradient_mismatch``: three real forms of a wrong derivative, and stop-gradients that are not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import Swish, ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn

import gradwatch
from gradwatch.probes._sandbox import Budget
from gradwatch.probes.gradient import gradient_agreement

CHECK = "gradient_mismatch"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any = ce, opt: Any = None) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, opt, config=CFG)


# -- the bugs -------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """A custom linear whose weight gradient is transposed the wrong way round (square)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, (g.t() @ x).t(), g.sum(0)


class SwishNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(Swish.apply(self.a(x)))


class DataEditNet(nn.Module):
    """Clamps its activations through ``.data``: the forward changes, the graph does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h.data = h.data * 0.5 + 0.1  # "rescale for stability"
        return self.b(torch.tanh(h))


class CustomLinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 16)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.3)
        self.bias = nn.Parameter(torch.zeros(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(_Linear.apply(torch.tanh(self.a(x)), self.w, self.bias)))


@pytest.mark.parametrize("make", [SwishNet, DataEditNet, CustomLinearNet])
def test_a_wrong_derivative_is_found(make: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), data())
    (finding,) = findings(report, CHECK)
    assert finding.severity == "error" and report.failed
    assert finding.details["layers"] and finding.module
    assert verdicts(report) == {CHECK: "finding"}


def test_the_finding_names_the_custom_function_and_brackets_it() -> None:
    torch.manual_seed(0)
    (finding,) = findings(_probe(SwishNet(), data()), CHECK)
    assert finding.details["custom_functions"] == ["Swish"]
    assert finding.details["between"] == ["a", "b"]  # the bad op is after a, before b


# -- look-alikes ----------------------------------------------------------------------------


class SimSiam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.pred = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        return self.enc(x)


def simsiam_loss(m: Any, b: Any) -> Tensor:
    x1 = b[0] + 0.1 * torch.randn_like(b[0])  # augmentations drawn from the global RNG
    x2 = b[0] + 0.1 * torch.randn_like(b[0])
    z1, z2 = m(x1), m(x2)
    p1, p2 = m.pred(z1), m.pred(z2)
    return (
        -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean())
        / 2
    )


class Byol(nn.Module):
    """An online network, and a target network run under no_grad (its own weights trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.target = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.pred = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.online(x)


def byol_loss(m: Any, b: Any) -> Tensor:
    p = m.pred(m(b[0] + 0.1 * torch.randn_like(b[0])))
    with torch.no_grad():
        t = m.target(b[0] + 0.1 * torch.randn_like(b[0]))
    return (2 - 2 * F.cosine_similarity(p, t)).mean()


class VQVAE(nn.Module):
    """Straight-through quantisation (``z + (q - z).detach()``) and its codebook losses."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.code, self.dec = nn.Linear(4, 8), nn.Embedding(16, 8), nn.Linear(8, 4)
        self.aux = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        z = self.enc(x)
        q = self.code.weight[torch.cdist(z, self.code.weight).argmin(-1)]
        self.aux = F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())
        return self.dec(z + (q - z).detach())


def vq_loss(m: Any, b: Any) -> Tensor:
    return F.mse_loss(m(b[0]), b[0]) + m.aux


class _SignSTE(torch.autograd.Function):
    """Binarisation with a straight-through gradient, declared as such."""

    straight_through = True

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return torch.sign(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class BinaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(_SignSTE.apply(self.a(x)))


class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
        self.D = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def d_loss(m: Any, b: Any) -> Tensor:
    fake = m.G(torch.randn(len(b[0]), 2)).detach()  # noise in float32 whatever the model
    ones, zeros = torch.ones(len(b[0]), 1), torch.zeros(len(b[0]), 1)
    return F.binary_cross_entropy_with_logits(m.D(b[0]), ones) + F.binary_cross_entropy_with_logits(
        m.D(fake), zeros
    )


def reinforce(m: Any, b: Any) -> Tensor:
    dist = torch.distributions.Categorical(logits=m(b[0]))
    action = dist.sample()
    reward = (action == 1).float() - 0.5
    return -(dist.log_prob(action) * reward).mean()


def actor_critic(m: Any, b: Any) -> Tensor:
    logits, value = m(b[0])[:, :3], m(b[0])[:, 3]
    dist = torch.distributions.Categorical(logits=logits)
    action = dist.sample()
    advantage = (action == 2).float() - value
    return -(dist.log_prob(action) * advantage.detach()).mean() + advantage.pow(2).mean()


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


LOOK_ALIKES = {
    "simsiam": (SimSiam, simsiam_loss),
    "byol": (Byol, byol_loss),
    "vqvae": (VQVAE, vq_loss),
    "binary_ste": (BinaryNet, ce),
    "gan_d_step": (Gan, d_loss),
    "reinforce": (lambda: mlp(out=3), reinforce),
    "actor_critic": (lambda: mlp(out=4), actor_critic),
    "dropout": (dropout_mlp, ce),
    "batchnorm": (bn_mlp, ce),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_correct_models_agree(name: str) -> None:
    make, loss_fn = LOOK_ALIKES[name]
    torch.manual_seed(0)
    report = _probe(make(), data(), loss_fn)
    assert not findings(report, CHECK), findings(report, CHECK)[0].message
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].note


def test_a_declared_straight_through_estimator_is_explained() -> None:
    torch.manual_seed(0)
    (record,) = _probe(BinaryNet(), data()).probes
    assert {r.name: r.status for r in record.layers}["a"] == "explained"
    assert record.details["straight_through"] == ["_SignSTE"]


def test_a_loss_that_keeps_state_is_not_judged() -> None:
    calls = [0]

    def drifting(m: Any, b: Any) -> Tensor:
        calls[0] += 1
        return ce(m, b) * (1 + 0.01 * calls[0])

    report = _probe(mlp(), data(), drifting)
    assert verdicts(report) == {CHECK: "not_observed"}
    (note,) = [f for f in report.findings if f.check == "not_observed"]
    assert note.severity == "info" and note.details["reason"] == "probe_not_reproducible"


def test_over_budget_it_samples_layers_and_says_so() -> None:
    torch.manual_seed(0)
    deep = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(8, 8), nn.Tanh())])
    cfg = {**CFG, "checks": {**CFG["checks"], CHECK: {"budget_s": 1e-6}}}
    report = gradwatch.probe(deep, (torch.randn(8, 8), torch.randn(8, 8)), _mse, config=cfg)
    (record,) = report.probes
    assert record.sampled and "none of the 12 layers" in record.note  # no time left for one
    assert record.verdict == "passed" and not record.layers
    assert record.details["joint"]["status"] == "agree"  # every layer, along one direction


class _HalfTanh(nn.Module):
    """tanh whose hand-written backward halves the gradient (a fused kernel's mistake)."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            y = torch.tanh(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (y,) = ctx.saved_tensors
            return 0.5 * g * (1.0 - y * y)

    def forward(self, x: Tensor) -> Tensor:
        return self._Fn.apply(x)


@pytest.mark.parametrize("where", [1, 5, 9])
def test_over_budget_a_wrong_derivative_in_a_layer_left_out_is_still_found(where: int) -> None:
    """The one layer compared alone is after the wrong backward (it agrees); every layer at
    once along one direction does not, so the finding says the budget left the layer out."""
    torch.manual_seed(0)
    acts = [_HalfTanh() if i == where else nn.Tanh() for i in range(12)]
    deep = nn.Sequential(*[m for i in range(12) for m in (nn.Linear(8, 8), acts[i])])
    cfg = {**CFG, "checks": {**CFG["checks"], CHECK: {"budget_s": 1e-6}}}
    report = gradwatch.probe(deep, (torch.randn(8, 8), torch.randn(8, 8)), _mse, config=cfg)
    (record,) = report.probes
    assert record.sampled and record.verdict == "finding"
    assert all(row.status == "agree" for row in record.layers)
    (found,) = findings(report, CHECK)
    assert found.details["joint"]["status"] == "mismatch" and "budget" in found.message


def _mse(m: Any, b: Any) -> Tensor:
    return F.mse_loss(m(b[0]), b[1])


def _autocast_loss(m: Any, b: Any) -> Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(b[0])
    return F.cross_entropy(out.float(), b[1])


def test_mixed_precision_is_compared_at_its_own_precision() -> None:
    (record,) = _probe(mlp(), data(), _autocast_loss).probes
    assert record.verdict == "passed" and record.details["dtype"] == "autocast"


def test_a_hf_gpt2_whose_loss_is_upcast_to_float32_agrees() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    report = _probe(model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss)
    assert verdicts(report) == {CHECK: "passed"}, [f.message for f in report.findings]
    # ForCausalLMLoss's logits.float() and every RMSNorm-style upcast stay float64 on the copy
    assert report.probes[0].details["dtype"] == "float64"


class UpcastNorm(nn.Module):
    """An RMSNorm as Llama's: computed in float32 whatever the input, cast back after."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Float32Gate(nn.Module):
    """``x * softmax(x)``, the softmax asked for in float32 as Hugging Face's eager attention."""

    def forward(self, x: Tensor) -> Tensor:
        return x * F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)


def test_a_float32_upcast_inside_the_model_stays_float64_on_the_copy() -> None:
    """Without it, the layers before the norm were judged at a float64 step against a
    function rounded to float32: a 5 % "mismatch" on Hugging Face's Arcee, a correct model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), UpcastNorm(32))
    model.extend([nn.Linear(32, 32), Float32Gate(), nn.Linear(32, 10)])
    result = gradient_agreement(model, data(), ce, rtol=1e-3, budget=Budget(60.0), max_samples=16)
    assert result.dtype == "float64"
    # rounded to float32 inside, the layers before the norm were "inconclusive" (0.3 % off)
    assert {row.name: row.status for row in result.layers} == dict.fromkeys("02346", "agree")


def _float32_only(m: nn.Module, b: Any) -> Tensor:
    """A loss that builds float32 tensors of its own (the copy stays float32), whose one
    layer's share is far below a float32 loss's last digit."""
    offset = torch.full((), 10.0, dtype=torch.float32)
    return offset + 1e-7 * m(b[0].to(torch.float32)).float().pow(2).mean()


def test_a_change_below_the_losss_rounding_is_not_a_mismatch() -> None:
    """At float32 a loss of 10 moves by 1e-6 at the least: a layer whose share is smaller
    reads 0 at h and 2h alike, which is rounding, not a wrong derivative."""
    torch.manual_seed(0)
    report = _probe(mlp(), data(), _float32_only)
    assert not findings(report, CHECK), [f.message for f in report.findings]


class MaskedAttention(nn.Module):
    """A decoder block whose forward builds its causal mask with ``torch.full`` (float32 by
    default), as many GPT re-implementations do; on the float64 copy the mask must follow,
    since a float32 mask in a float64 ``nn.MultiheadAttention`` has a wrong backward in
    torch 2.13 (CPU, 8 positions or more), which would read as the user's bug."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn = nn.Embedding(50, 16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.emb(ids)
        return self.head(h + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])


def test_a_mask_the_forward_builds_in_the_default_dtype_agrees() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(0))

    def lm(m: Any, b: Any) -> Tensor:
        return F.cross_entropy(m(b[:, :-1]).reshape(-1, 50), b[:, 1:].reshape(-1))

    report = _probe(MaskedAttention(), ids, lm)
    (record,) = report.probes
    assert record.verdict == "passed", [f.message for f in report.findings]
    assert record.details["dtype"] == "float64" and torch.get_default_dtype() == torch.float32


class _SoftClip(torch.autograd.Function):
    """A hand-written clip to [-3, 3] whose backward forgot the clipped region's zero."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clamp(-3.0, 3.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class ClippedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(_SoftClip.apply(self.a(x)))


def test_a_wrong_derivative_in_one_sample_of_the_middle_of_the_batch_is_found() -> None:
    """Issue 47 item 9: only sample 9 of 16 reaches the clipped region; the probe's samples
    are spread over the batch, so it is among them."""
    torch.manual_seed(0)
    model = ClippedInput()
    x, y = data(n=16)
    x = x.clamp(-0.3, 0.3)
    x[9] = 40.0
    with torch.no_grad():
        assert bool((model.a(x[:8]).abs() < 3).all()) and bool((model.a(x[9]).abs() > 3).any())
    (finding,) = findings(_probe(model, (x, y)), CHECK)
    assert "_SoftClip" in finding.details["custom_functions"]
