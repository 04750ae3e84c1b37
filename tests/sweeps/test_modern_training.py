"""No false alarms on correct modern training, no silent misses (issue 12), on real loops.

MoE routing, LayerDrop, SWA copies, reentrant checkpointing, transformers at init,
LayerScale, backward passes that raise, a zero_grad forgotten once late in the run.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from _loops import batches, fired, mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradwatch

# -- ghost_param: intermittent ghosts ----------------------------------------------------------


class TopOneMoE(nn.Module):
    """A top-1 router over ``n`` experts; ``block`` experts are never routed to."""

    def __init__(self, n: int = 4, dim: int = 8, block: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])
        self.head = nn.Linear(dim, 1)
        self.block = block
        self.routed: list[set[int]] = []  # which experts got tokens, per forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        for k in self.block:
            logits[:, k] = -1e9
        gate = logits.softmax(-1)
        top = gate.argmax(-1)
        self.routed.append({int(k) for k in top.unique()})
        h = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            rows = top == k
            if rows.any():  # an idle expert is not called at all (as in real MoE kernels)
                h[rows] = expert(x[rows]) * gate[rows, k : k + 1]
        return self.head(h)


def _moe_run(block: tuple[int, ...]) -> tuple[TopOneMoE, gradwatch.Report]:
    torch.manual_seed(0)
    model = TopOneMoE(block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(8, batch=3, seed=3):  # 3 tokens, 4 experts: some idle each step
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model, w.report()


def test_moe_idle_experts_are_info_and_a_never_routed_expert_is_an_error() -> None:
    model, report = _moe_run(block=(3,))
    steps = len(model.routed)
    used = {k: sum(k in r for r in model.routed) for k in range(4)}
    idle = {k for k in range(3) if 0 < used[k] < steps}
    assert idle, model.routed  # the run does have experts idle in some steps
    ghosts = {f.module: f for f in report.by_check("ghost_param")}
    assert set(ghosts) == {f"experts.{k}" for k in idle} | {"experts.3"}
    for k in idle:
        f = ghosts[f"experts.{k}"]
        assert f.severity == "info"
        assert f.details["intermittent"] is True
        assert f.details["steps_seen"] == used[k]
        assert f.details["steps_missing"] == steps - used[k]
        assert f.details["cause"] == "not_called"
        assert f"in {steps - used[k]} of {steps} steps" in f.message
    dead = ghosts["experts.3"]
    assert (dead.severity, dead.details["intermittent"]) == ("error", False)
    assert dead.details["steps_missing"] == steps and dead.details["steps_seen"] == 0
    assert dead.params == ["experts.3.weight", "experts.3.bias"]
    assert fired(report) == {"ghost_param"} and report.failed


def test_moe_with_every_expert_sometimes_idle_passes() -> None:
    _, report = _moe_run(block=())
    assert report.by_check("ghost_param")
    assert {f.severity for f in report.findings} == {"info"}
    assert not report.failed


class LayerDropEncoder(nn.Module):
    """Residual layers, each skipped with probability ``p`` in training (LayerDrop)."""

    def __init__(self, depth: int = 4, dim: int = 8, p: float = 0.5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 1)
        self.p = p
        self.dropped: list[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = (torch.rand(len(self.layers)) < self.p).tolist()
        self.dropped.append(drop)
        for layer, skip in zip(self.layers, drop):
            if not skip:
                x = x + torch.tanh(layer(x))
        return self.head(x)


def test_layerdrop_layers_are_intermittent_info_with_exact_counts() -> None:
    torch.manual_seed(1)
    model = LayerDropEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(10):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    report = w.report()
    ghosts = {f.module: f for f in report.by_check("ghost_param")}
    expected = {}
    for k in range(4):
        missing = sum(d[k] for d in model.dropped)
        if missing:
            expected[f"layers.{k}"] = (missing, len(model.dropped) - missing)
    assert {
        m: (f.details["steps_missing"], f.details["steps_seen"]) for m, f in ghosts.items()
    } == expected
    for f in ghosts.values():
        never_seen = f.details["steps_seen"] == 0
        assert f.severity == ("error" if never_seen else "info")
        assert "LayerDrop" in f.hint or never_seen
    assert not report.failed or any(f.details["steps_seen"] == 0 for f in ghosts.values())


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(h)


def test_a_ghost_missing_at_step_0_only_is_rewritten_as_intermittent() -> None:
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(gradwatch.GradWatchWarning, match="ghost_param"):  # at step 0: error
        with gradwatch.watch(model, opt) as w:
            for step, (x, y) in enumerate(batches(4)):
                model.use_extra = step > 0
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    report = w.report()
    (f,) = report.by_check("ghost_param")
    assert f.severity == "info" and not report.failed
    assert {k: f.details[k] for k in ("cause", "steps_missing", "steps_seen", "intermittent")} == {
        "cause": "not_called",
        "steps_missing": 1,
        "steps_seen": 3,
        "intermittent": True,
    }
    assert "in 1 of 4 steps" in f.message
    assert "find_unused_parameters" in f.hint
    assert (f.first_step, f.last_step, f.count) == (0, 0, 1)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("find_unused", "severity"), [(True, "info"), (False, "error")])
def test_intermittent_ghost_under_ddp_depends_on_find_unused_parameters(
    one_rank_group: Any, find_unused: bool, severity: str
) -> None:
    torch.manual_seed(0)
    model = Branchy()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with gradwatch.watch(ddp, opt, config={"warn": False}) as w:
        for step, (x, y) in enumerate(batches(2)):  # without find_unused a 3rd forward dies
            model.use_extra = step == 0
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    (f,) = w.report().by_check("ghost_param")
    assert f.details["intermittent"] is True and f.severity == severity
    assert f.params == ["extra.weight", "extra.bias"]


# -- not_in_optimizer: SWA / EMA copies ------------------------------------------------------


def test_swa_averaged_model_in_the_container_is_info() -> None:
    torch.manual_seed(0)
    net = mlp()
    swa = torch.optim.swa_utils.AveragedModel(net)
    both = nn.ModuleDict({"net": net, "swa": swa})
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with gradwatch.watch(both, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(6):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            swa.update_parameters(net)
    report = w.report()
    orphans = report.by_check("not_in_optimizer")
    assert {f.module for f in orphans} == {"swa"}  # one subtree left out: one finding
    assert {f.severity for f in orphans} == {"info"}
    assert {p for f in orphans for p in f.params} == {
        "swa.module.0.weight",
        "swa.module.0.bias",
        "swa.module.2.weight",
        "swa.module.2.bias",
    }
    assert fired(report) == set() and not report.failed


def test_undetached_ema_teacher_receiving_gradients_is_a_warning() -> None:
    torch.manual_seed(0)
    student = mlp()
    teacher = copy.deepcopy(student)  # EMA copy, but its output is not detached
    both = nn.ModuleDict({"student": student, "teacher": teacher})
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    with gradwatch.watch(both, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(4):
            opt.zero_grad()
            loss = nn.functional.mse_loss(student(x), y)
            loss = loss + nn.functional.mse_loss(student(x), teacher(x))  # no .detach()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pt, ps in zip(teacher.parameters(), student.parameters()):
                    pt.mul_(0.9).add_(ps, alpha=0.1)
    orphans = w.report().by_check("not_in_optimizer")
    # one subtree, one finding; half of the model, not most of it: a warning
    assert {f.module: f.severity for f in orphans} == {"teacher": "warning"}
    assert all(f.details["receives_grad"] for f in orphans)
    assert fired(w.report()) == {"not_in_optimizer"}


# -- reentrant checkpointing (LoRA + gradient checkpointing) -----------------------------------


class LoraLinear(nn.Module):
    def __init__(self, dim: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim).requires_grad_(False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        # Not zero-initialised: without an optimizer B would stay zero and A's gradient
        # exactly zero for ever (a true dead_param).
        self.lora_b = nn.Linear(rank, dim, bias=False)
        self.adapter_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.base(x))
        return out + self.lora_b(self.lora_a(x)) if self.adapter_on else out


class CheckpointedLora(nn.Module):
    """Frozen embedding and head; trainable adapters only inside reentrant checkpoints."""

    def __init__(self, depth: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim).requires_grad_(False)
        self.blocks = nn.ModuleList([LoraLinear(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).requires_grad_()  # as enable_input_require_grads() does
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.head(h)


def _lora_run(with_optimizer: bool, off: Optional[int] = None) -> gradwatch.Report:
    torch.manual_seed(0)
    model = CheckpointedLora()
    if off is not None:
        model.blocks[off].adapter_on = False
    opt = None
    if with_optimizer:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for x, y in batches(5):
            if opt is not None:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if opt is not None:
                opt.step()
    return w.report()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_reentrant_checkpoint_is_one_backward_and_no_ghost(with_optimizer: bool) -> None:
    report = _lora_run(with_optimizer)
    assert report.backward_passes == 5 and report.steps == 5
    assert report.by_check("ghost_param") == []
    assert fired(report) == set()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_reentrant_checkpoint_still_finds_an_adapter_never_called(with_optimizer: bool) -> None:
    report = _lora_run(with_optimizer, off=1)
    assert report.backward_passes == 5 and report.steps == 5
    ghosts = {f.module: f for f in report.by_check("ghost_param")}
    # both adapters of block 1 (all of its trainable parameters): one finding
    assert set(ghosts) == {"blocks.1"}
    assert ghosts["blocks.1"].details["layers"] == ["blocks.1.lora_a", "blocks.1.lora_b"]
    for f in ghosts.values():
        assert f.severity == "error" and f.details["cause"] == "not_called"
        assert f.details["steps_missing"] == 5 and f.details["steps_seen"] == 0


# -- vanishing_grad relative to the layer's own scale ------------------------------------------


class LayerScaleBlock(nn.Module):
    """``x + gamma * mlp(norm(x))`` with ``gamma`` initialised to 1e-5 (CaiT, ConvNeXt)."""

    def __init__(self, dim: int = 16, init: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _layer(report: gradwatch.Report, name: str) -> Any:
    return next(row for row in report.layers if row.name == name)


def test_layerscale_blocks_at_init_under_adamw_are_not_vanishing() -> None:
    """ConvNeXt's default layer scale (1e-6) during learning-rate warmup."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), LayerScaleBlock(init=1e-6), LayerScaleBlock(init=1e-6), nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 100)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(5):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            warmup.step()
    report = w.report()
    # The blocks' inner layers have gradients below the old absolute limit...
    tiny = {r.name for r in report.layers if r.mean_abs_grad and r.mean_abs_grad < 1e-7}
    assert tiny == {"1.norm", "1.fc1", "1.fc2", "2.norm", "2.fc1", "2.fc2"}
    # ...yet AdamW moves them about as much as the plain linear layers: healthy.
    slowest = min(_layer(report, name).update_ratio for name in ("0", "3"))
    assert all(_layer(report, name).update_ratio > 0.05 * slowest for name in tiny)
    assert report.by_check("vanishing_grad") == []
    assert fired(report, "info") == set()


@pytest.mark.floor  # a transformers BART
def test_bart_attention_at_init_under_adamw_is_not_vanishing() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=99,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
    )
    model = transformers.BartForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for _ in range(4):
            opt.zero_grad()
            ids = torch.randint(3, 99, (2, 8), generator=g)
            model(input_ids=ids, labels=torch.randint(3, 99, (2, 6), generator=g)).loss.backward()
            opt.step()
    report = w.report()
    k_proj = _layer(report, "model.encoder.layers.0.self_attn.k_proj")
    assert k_proj.mean_abs_grad < 1e-7  # what the absolute rule alone called vanishing
    assert report.by_check("vanishing_grad") == []
    assert fired(report) == set()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", None])
def test_deep_saturated_sigmoid_chain_still_vanishes(optimizer: Optional[str]) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(25):
        layers += [nn.Linear(8, 8), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(8, 1))
    opt: Optional[torch.optim.Optimizer] = None
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for x, y in batches(4):
            if opt is not None:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if opt is not None:
                opt.step()
    vanishing = {f.module: f for f in w.report().by_check("vanishing_grad")}
    assert "0" in vanishing and "48" not in vanishing and "50" not in vanishing
    assert vanishing["0"].first_step == 2
    assert vanishing["0"].params == ["0.weight", "0.bias"]


# -- a backward that raises mid-run ----------------------------------------------------------


class Fragile(nn.Module):
    """Its first layer's gradient hook raises on demand (as an OOM in a user hook would)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.use_extra = True
        self.fail = False
        self.nan_gate = 1.0
        self.body.weight.register_hook(self._maybe_raise)

    def _maybe_raise(self, grad: torch.Tensor) -> None:
        if self.fail:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        # |h|**0.5 at an exact zero: its backward is 0 * inf = NaN (anomaly mode raises)
        h = torch.sqrt(torch.abs(self.mid(h) * self.nan_gate) + 1e-3 * self.nan_gate)
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(h)


@pytest.mark.parametrize("how", ["hook_oom", "anomaly_nan"])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_backward_that_raises_does_not_switch_checks_off(how: str, with_optimizer: bool) -> None:
    torch.manual_seed(0)
    model = Fragile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01) if with_optimizer else None
    failed = 0
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "warn": False}) as w:
        for step, (x, y) in enumerate(batches(8, out=1)):
            model.fail = how == "hook_oom" and step == 2
            model.nan_gate = 0.0 if how == "anomaly_nan" and step == 2 else 1.0
            model.use_extra = step < 5  # an intermittent ghost from batch 5 on
            if step == 4:  # a new layer, never called: a permanent ghost
                model.late = nn.Linear(16, 16)
                if opt is not None:
                    opt.add_param_group({"params": list(model.late.parameters())})
            if opt is not None:
                opt.zero_grad()
            try:
                with torch.autograd.set_detect_anomaly(how == "anomaly_nan"):
                    nn.functional.mse_loss(model(x), y).backward()
            except RuntimeError as exc:  # the loop skips the batch
                assert ("out of memory" in str(exc)) or ("nan" in str(exc))
                assert model.head.weight.grad is not None  # some gradients had arrived
                failed += 1
                continue
            if opt is not None:
                if step == 6:
                    opt.zero_grad()  # a real bug: zero_grad between backward and step
                opt.step()
    report = w.report()
    assert failed == 1
    assert report.backward_passes == 7 and report.steps == 7
    ghosts = {f.module: f for f in report.by_check("ghost_param")}
    assert set(ghosts) == {"extra", "late"}
    extra, late = ghosts["extra"], ghosts["late"]
    assert (extra.severity, extra.details["cause"]) == ("info", "not_called")
    assert (extra.details["steps_missing"], extra.details["steps_seen"]) == (3, 4)
    assert (late.severity, late.details["cause"]) == ("error", "not_called")
    assert late.details["steps_seen"] == 0 and late.details["steps_missing"] >= 2
    if with_optimizer:
        (swg,) = report.by_check("step_without_grad")
        assert swg.first_step == 5  # the 6th step (one batch was skipped)
        assert fired(report) == {"ghost_param", "step_without_grad"}
    else:
        assert fired(report) == {"ghost_param"}


# -- trimming never loses a detection --------------------------------------------------------


@pytest.mark.parametrize("late", [20, 200])
def test_a_zero_grad_forgotten_once_late_is_reported(late: int) -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:  # default trim_hooks_after
        assert w.config.trim_hooks_after is not None and w.config.trim_hooks_after < late
        for k, (x, y) in enumerate(batches(late + 4)):
            if k != late:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    (f,) = w.report().by_check("missing_zero_grad")
    assert (f.first_step, f.last_step, f.count) == (late, late, 1)
    assert f.params == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert fired(w.report(), "info") == {"missing_zero_grad"}


def test_gan_after_the_trim_stays_silent() -> None:
    """D's backward starts while G still holds its last step's gradient: not a miss."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"G": G, "D": D})
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    with gradwatch.watch(gan, [opt_d, opt_g], config={"trim_hooks_after": 2}) as w:
        for _ in range(12):
            real, z = torch.randn(8, 8), torch.randn(8, 4)
            D.zero_grad()
            fake = G(z)
            (bce(D(real), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))).backward()
            opt_d.step()
            G.zero_grad()
            bce(D(fake), torch.ones(8, 1)).backward()
            opt_g.step()
    assert fired(w.report(), "info") == set()
