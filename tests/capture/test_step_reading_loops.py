"""Real-world loop shapes: the same findings with arrivals read at the step as with every hook.

Each loop below is a training pattern found in public code, written out with its usual
calls: SAM and Lookahead, an EMA copy with clipping by value, weight/spectral norm
parametrizations, bf16 autocast with a fused optimizer, WGAN-GP (double backward), truncated
BPTT, distillation with a momentum encoder, tied embeddings, the torch Transformer with
OneCycleLR, sparse embeddings with a second optimizer, MAML through ``functional_call``,
``backward(inputs=...)``, and a CLIP-style two-tower model next to a layer trained by
hand-written gradients. Each runs three times: every hook on (``trim_hooks_after: None``,
the ground truth), the default configuration, and the reading forced on these ~80-tensor
models from step 3 (its thresholds lowered). All three must train bit-identically and
report the same findings, and a correct loop reports nothing above ``info``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from _wrappers import SAM, Lookahead
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

import gradwatch
from gradwatch.capture.grads import step_reading

pytestmark = pytest.mark.slow

STEPS = 20
Run = Callable[[dict[str, Any]], tuple[Any, list[float]]]
LOOPS: dict[str, Run] = {}


def loop(fn: Run) -> Run:
    LOOPS[fn.__name__] = fn
    return fn


class Res(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.3 * torch.tanh(self.lin(x))


def mlp(depth: int = 40) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Res() for _ in range(depth)], nn.Linear(16, 1))


def data(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s % 8)
    return torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)


def train(model: nn.Module, opt: Any, cfg: dict[str, Any], step: Callable[..., Any]) -> Any:
    losses: list[float] = []
    with gradwatch.watch(model, opt, config=cfg) as w:
        for s in range(STEPS):
            losses.append(step(s, *data(s)).detach().item())
    return w, losses


def plain(model: nn.Module, opt: Any, before: Callable[[], None] = lambda: None) -> Any:
    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        before()
        opt.step()
        return loss

    return step


@loop
def sam(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = SAM(m.parameters(), torch.optim.SGD, lr=0.05)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.first_step(zero_grad=True)
        F.mse_loss(m(x), y).backward()
        opt.second_step(zero_grad=True)
        return loss

    return train(m, opt, cfg, step)


@loop
def lookahead(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-3))
    return train(m, opt, cfg, plain(m, opt))


@loop
def ema_and_clip_value(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    avg = torch.optim.swa_utils.get_ema_multi_avg_fn(0.99)
    ema = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=avg)
    clipped = plain(m, opt, lambda: nn.utils.clip_grad_value_(m.parameters(), 0.01))

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = clipped(s, x, y)
        ema.update_parameters(m)
        return loss

    return train(m, opt, cfg, step)


@loop
def parametrizations(cfg: dict[str, Any]) -> Any:
    m = mlp()
    norm = nn.utils.parametrizations
    for k, block in enumerate(b for b in m if isinstance(b, Res)):
        (norm.weight_norm if k % 2 else norm.spectral_norm)(block.lin)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return train(m, opt, cfg, plain(m, opt))


@loop
def autocast_bf16_fused(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def wgan_gp(cfg: dict[str, Any]) -> Any:
    critic, gen = mlp(20), mlp(20)
    o_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    o_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.0, 0.9))
    both = nn.ModuleDict({"critic": critic, "gen": gen})

    def step(s: int, real: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        z = torch.randn(16, 16, generator=torch.Generator().manual_seed(s))
        fake = gen(z).detach().expand(-1, 16)
        eps = torch.rand(16, 1, generator=torch.Generator().manual_seed(s))
        mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
        loss_c = critic(fake).mean() - critic(real).mean() + 10 * ((g.norm(dim=1) - 1) ** 2).mean()
        o_c.zero_grad()
        loss_c.backward()
        o_c.step()
        o_g.zero_grad()
        (-critic(gen(z).expand(-1, 16)).mean()).backward()
        o_g.step()
        return loss_c

    return train(both, [o_c, o_g], cfg, step)


@loop
def tbptt_lstm(cfg: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    rnn, head = nn.LSTM(16, 16, num_layers=4), mlp(30)
    m = nn.ModuleDict({"rnn": rnn, "head": head})
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    state: list[Any] = [None]

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = state[0] and tuple(t.detach() for t in state[0])
        opt.zero_grad()
        out, state[0] = rnn(x.view(4, 4, 16), h)
        loss = F.mse_loss(head(out).view(16, 1), y)
        loss.backward()
        opt.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def distill_and_momentum_encoder(cfg: dict[str, Any]) -> Any:
    student, teacher = mlp(), mlp()
    key = copy.deepcopy(student).requires_grad_(False)
    m = nn.ModuleDict({"student": student, "teacher": teacher, "key": key})
    opt = torch.optim.SGD(student.parameters(), lr=0.05)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pk, pq in zip(key.parameters(), student.parameters()):
                pk.mul_(0.99).add_(pq, alpha=0.01)
            target = teacher(x) + key(x)
        opt.zero_grad()
        loss = F.mse_loss(student(x), target) + F.mse_loss(student(x), y)
        loss.backward()
        opt.step()
        return loss

    return train(m, opt, cfg, step)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.blocks = nn.Embedding(50, 16), nn.Sequential(*[Res() for _ in range(40)])
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(t)))


@loop
def tied_lm(cfg: dict[str, Any]) -> Any:
    m = TiedLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = (x.abs() * 10).long().clamp(max=49)
        opt.zero_grad()
        loss = F.cross_entropy(m(t[:, :-1]).reshape(-1, 50), t[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def torch_transformer(cfg: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    m = nn.Sequential(enc, nn.Linear(16, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=STEPS)
    plain_step = plain(m, opt)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = plain_step(s, x.view(4, 4, 16), y.view(4, 4, 1))
        sched.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def sparse_embedding_two_optimizers(cfg: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    emb, net = nn.Embedding(1000, 16, sparse=True), mlp()
    m = nn.ModuleDict({"emb": emb, "net": net})
    opts = [torch.optim.SparseAdam([emb.weight], lr=1e-3), torch.optim.Adam(net.parameters())]

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = (x.abs() * 300).long().clamp(max=999)[:, :5]
        for o in opts:
            o.zero_grad()
        loss = F.mse_loss(net(emb(t).mean(1)), y)
        loss.backward()
        for o in opts:
            o.step()
        return loss

    return train(m, opts, cfg, step)


@loop
def maml(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        params: dict[str, torch.Tensor] = dict(m.named_parameters())
        inner = F.mse_loss(functional_call(m, params, (x,)), y)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.01 * g for (n, p), g in zip(params.items(), grads)}
        loss = F.mse_loss(functional_call(m, fast, (x,)), y)
        loss.backward()
        opt.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def backward_inputs_alternating(cfg: dict[str, Any]) -> Any:
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    first = list(m[:20].parameters())

    def step(s: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward(inputs=first if s % 2 else list(m.parameters()))
        opt.step()
        return loss

    return train(m, opt, cfg, step)


@loop
def two_towers_with_hand_written_rule(cfg: dict[str, Any]) -> Any:
    a, b, rule = mlp(20), mlp(20), mlp(3)
    scale = nn.Parameter(torch.tensor(2.6592))
    m = nn.ModuleDict({"a": a, "b": b, "rule": rule})
    m.register_parameter("logit_scale", scale)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step(s: int, x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        za, zb = F.normalize(a[:-1](x), dim=-1), F.normalize(b[:-1](x.flip(0)), dim=-1)
        logits = scale.exp() * za @ zb.t()
        opt.zero_grad()
        loss = F.cross_entropy(logits, torch.arange(16))
        loss.backward()
        for p in rule.parameters():  # a local learning rule: a non-zero gradient by hand
            p.grad = 1e-3 * torch.ones_like(p)
        opt.step()
        return loss

    return train(m, opt, cfg, step)


EXPECTED = {  # the findings above info of the loops with a bug in them
    "two_towers_with_hand_written_rule": {
        ("ghost_param", "error", "a.20"),
        ("ghost_param", "error", "b.20"),
    },
}
MODES: dict[str, dict[str, Any]] = {
    "every_hook": {"trim_hooks_after": None},
    "default": {},
    "forced": {"trim_hooks_after": 3},
}


def _findings(report: gradwatch.Report) -> list[tuple[str, str, tuple[str, ...], str]]:
    return sorted(
        (f.check, f.severity, tuple(sorted(f.params)), str(f.module)) for f in report.findings
    )


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_same_findings_in_every_mode(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {}
    original = step_reading.StepReading.read_arrivals
    for mode, cfg in MODES.items():
        lowered = (2, 2, 2) if mode == "forced" else (64, 16, 16)
        for attr, value in zip(("MIN_READ", "SENTINELS", "ROTATE"), lowered):
            monkeypatch.setattr(step_reading, attr, value)
        read: list[int] = []

        def counting(self: Any, *args: Any, _orig: Any = original, _read: Any = read) -> None:
            _read.append(len(self.hooks.unhooked))
            _orig(self, *args)

        monkeypatch.setattr(step_reading.StepReading, "read_arrivals", counting)
        w, losses = LOOPS[name]({"warn": False, "on_internal_error": "raise", **cfg})
        results[mode] = (_findings(w.report()), losses, sum(read))
    truth, truth_losses, _ = results["every_hook"]
    for mode, (found, losses, _) in results.items():
        assert losses == truth_losses, mode
        assert found == truth, mode
    assert results["forced"][2] > 0  # the reading did run
    serious = {(c, s, m) for c, s, _, m in truth if s != "info"}
    assert serious == EXPECTED.get(name, set())
