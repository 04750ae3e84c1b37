"""The probes on correct, realistic small models: no false alarm, and honest verdicts.

``gradwatch.probe`` (``sample_dependence``, ``gradient_mismatch``, ``does_not_learn``, default
config) on: PEFT LoRA adapters on tiny transformers models built from configs (base frozen);
opacus, a ``make_private`` model with its ``DPOptimizer`` and a bare ``GradSampleModule``;
quantisation-aware training (``prepare_qat`` on a fused conv net: fake quantisation is a
straight-through estimator, so its layers are ``explained``); and timm-like pure-torch models
(timm is not a dependency): a ViT (patch embedding, class token, LayerNorm, GELU, DropPath)
and a ConvNeXt (depthwise 7x7 conv, channels-last LayerNorm, LayerScale). Each case names
every probe's verdict, and for a ``not_observed`` its reason; no finding reaches ``warning``.
The last tests keep the bugs caught that the fixes these models needed could have hidden.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from _threads import one_thread
from torch import Tensor, nn

import gradwatch
from gradwatch.probes import PROBES

__all__ = ["one_thread"]  # autouse: tiny models on one thread, as in tests/probes/

Built = tuple[nn.Module, Any, Callable[[nn.Module, Any], Tensor], Any]
PASSED = {
    "sample_dependence": "passed",
    "gradient_mismatch": "passed",
    "does_not_learn": "passed",
    "forward_not_reproducible": "passed",
    "batch_order_dependent": "passed",
}
FIELD = "dependence_outside_receptive_field"  # these models have no bounded field: not judged

# Third-party noise, emitted by ordinary training with these libraries too.
QUANT = [
    pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max"),
]
OPACUS = [
    pytest.mark.floor,
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ce(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def _hf(m: nn.Module, b: Any) -> Tensor:
    return m(**b).loss


def _images(n: int = 8, size: int = 16, chans: int = 3) -> tuple[Tensor, Tensor]:
    return torch.randn(n, chans, size, size, generator=_gen(0)), torch.randint(
        0, 10, (n,), generator=_gen(1)
    )


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --- PEFT LoRA on tiny transformers models ----------------------------------------------------
def _peft(base: nn.Module, cfg: Any) -> nn.Module:
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a deprecated question while wrapping.
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        return peft.get_peft_model(base, cfg)


def _gpt2_lora(init: float) -> Built:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, initializer_range=init
    )
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.05)
    model = _peft(transformers.GPT2LMHeadModel(cfg), lora)
    ids = torch.randint(0, 100, (4, 12), generator=_gen(0))
    opt = torch.optim.AdamW(_trainable(model), lr=1e-3)
    return model, {"input_ids": ids, "labels": ids}, _hf, opt


def gpt2_lora() -> Built:
    # Weights at a trained model's scale: with the default 0.02 the frozen tied embedding
    # bounds every logit to +-0.6 (see the xfail case below).
    return _gpt2_lora(init=0.2)


def gpt2_lora_at_random_init() -> Built:
    return _gpt2_lora(init=0.02)


def bert_lora_classifier() -> Built:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    # SEQ_CLS trains the new classifier head too (peft's modules_to_save).
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    model = _peft(transformers.BertForSequenceClassification(cfg), lora)
    ids = torch.randint(1, 100, (8, 12), generator=_gen(0))
    mask = torch.ones_like(ids)
    mask[4:, 9:] = 0  # padded samples
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (8,))}
    return model, batch, _hf, torch.optim.AdamW(_trainable(model), lr=1e-3)


# --- opacus ------------------------------------------------------------------------------------
def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10)
    )


def opacus_make_private() -> Built:
    opacus = pytest.importorskip("opacus")
    x, y = torch.randn(8, 1, 8, 8, generator=_gen(0)), torch.randint(0, 10, (8,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    net = _small_cnn()
    model, opt, _ = opacus.PrivacyEngine().make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    return model, (x, y), _ce, opt


def opacus_grad_sample_module() -> Built:
    opacus = pytest.importorskip("opacus")
    model = opacus.GradSampleModule(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    batch = (torch.randn(8, 6, generator=_gen(0)), torch.randint(0, 3, (8,), generator=_gen(1)))
    return model, batch, _ce, torch.optim.Adam(model.parameters(), lr=1e-2)


# --- quantisation-aware training ---------------------------------------------------------------
class _QatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
        )
        self.conv2, self.relu2 = nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.bn1(self.conv1(self.quant(x))))
        x = self.relu2(self.conv2(x)).mean((2, 3))
        return self.dequant(self.fc(x))


def _prepared(net: nn.Module) -> nn.Module:
    net.train()
    net.qconfig = tq.get_default_qat_qconfig("x86")  # fused observer + fake quant, per channel
    tq.fuse_modules_qat(net, [["conv1", "bn1", "relu1"], ["conv2", "relu2"]], inplace=True)
    return tq.prepare_qat(net)


def qat_conv_net() -> Built:
    model = _prepared(_QatNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, _images(size=8), _ce, opt


# --- timm-like models, in pure torch -----------------------------------------------------------
class DropPath(nn.Module):
    """Stochastic depth per sample, as timm's ``DropPath``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class _VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, drop_path: float) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class TinyViT(nn.Module):
    def __init__(self, img: int = 16, patch: int = 4, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(_VitBlock(dim, 2, 0.0), _VitBlock(dim, 2, 0.1))
        self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (timm's ``LayerNorm2d``)."""

    def forward(self, x: Tensor) -> Tensor:
        x = F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps
        )
        return x.permute(0, 3, 1, 2)


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, ls_init: float = 1e-6) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(ls_init * torch.ones(dim))  # LayerScale

    def forward(self, x: Tensor) -> Tensor:
        y = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, int] = (16, 32), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6)
        )
        self.stages = nn.Sequential(
            _ConvNeXtBlock(dims[0]),
            nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, stride=2)),
            _ConvNeXtBlock(dims[1]),
        )
        self.norm, self.head = nn.LayerNorm(dims[1], eps=1e-6), nn.Linear(dims[1], classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


def vit() -> Built:
    model = TinyViT()
    return model, _images(), _ce, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)


def convnext() -> Built:
    model = TinyConvNeXt()
    return model, _images(), _ce, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)


# --- the sweep ---------------------------------------------------------------------------------
@dataclass
class Case:
    build: Callable[[], Built]
    verdicts: dict[str, str] = field(default_factory=lambda: dict(PASSED))
    reasons: dict[str, str] = field(default_factory=dict)  # of each not_observed
    explained: bool = False  # every gradient_mismatch layer behind fake quantisation


CASES = [
    pytest.param(Case(gpt2_lora), id="peft-gpt2-lora", marks=pytest.mark.floor),
    pytest.param(Case(bert_lora_classifier), id="peft-bert-lora-seq-cls", marks=pytest.mark.floor),
    pytest.param(
        # DPOptimizer wraps the user's optimizer (its own __init__ needs the noise multiplier
        # and clipping norm): does_not_learn cannot re-create it, and says so.
        Case(
            opacus_make_private,
            verdicts={**PASSED, "does_not_learn": "not_observed"},
            reasons={"does_not_learn": "optimizer_not_copyable"},
        ),
        id="opacus-make-private",
        marks=OPACUS,
    ),
    pytest.param(Case(opacus_grad_sample_module), id="opacus-grad-sample-module", marks=OPACUS),
    pytest.param(Case(qat_conv_net, explained=True), id="qat-prepare-qat", marks=QUANT),
    pytest.param(Case(vit), id="timm-like-vit"),
    pytest.param(Case(convnext), id="timm-like-convnext"),
    pytest.param(
        # The frozen tied embedding after the frozen final LayerNorm bounds every logit to
        # +-0.6: no adapter fits the batch (nor 2 samples). A bound of the random frozen base,
        # not of the training step: said as no verdict, not a finding.
        Case(
            gpt2_lora_at_random_init,
            verdicts={**PASSED, "does_not_learn": "not_observed"},
            reasons={"does_not_learn": "frozen_base"},
        ),
        id="peft-gpt2-lora-random-base",
        marks=pytest.mark.floor,
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_the_probes_raise_no_false_alarm(case: Case) -> None:
    torch.manual_seed(0)
    model, batch, loss_fn, optimizer = case.build()
    # a loaded CI machine can spend does_not_learn's 5 s before these LoRA copies reach the
    # target (the run stops there, so room costs nothing on a quiet one)
    slack = {"checks": {"does_not_learn": {"budget_s": 30.0}}}
    report = gradwatch.probe(model, batch, loss_fn, optimizer, config=slack)
    loud = [f.line() for f in report.findings if f.severity in ("error", "warning")]
    assert not loud and not report.failed, loud
    records = {p.id: p for p in report.probes}
    field_record = records.pop(FIELD)
    # update_ascends_loss (this round) is judged by the loud findings above: its verdict on
    # these real architectures is not pinned yet (an optimizer it cannot re-create is said)
    records.pop("update_ascends_loss", None)
    # sample_weight_depends_on_split's probe is info without accumulation_steps: a padded
    # token loss weighs its halves by their tokens by design (judged in tests/probes)
    records.pop("sample_weight_depends_on_split", None)
    assert field_record.verdict == "not_observed" and field_record.note.startswith("not judged")
    assert {k: r.verdict for k, r in records.items()} == case.verdicts, [
        f.message for f in report.findings
    ]
    reasons = {k: r.details["reason"] for k, r in records.items() if r.verdict == "not_observed"}
    assert reasons == case.reasons
    layers = records["gradient_mismatch"].layers
    assert layers and all(row.status != "mismatch" for row in layers)
    if case.explained:  # fake quantisation is a straight-through estimator
        assert {row.status for row in layers} == {"explained"}
        assert records["gradient_mismatch"].details["straight_through"]


# --- the bugs those fixes must not hide -------------------------------------------------------
class _WrongTanh(torch.autograd.Function):
    """``tanh(3x)`` whose backward forgets the inner derivative, 3."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = torch.tanh(3.0 * x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return g * (1.0 - y * y)


class _Wrong(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _WrongTanh.apply(x)


def _gradient_only(model: nn.Module, batch: Any) -> gradwatch.ProbeResult:
    cfg = {"checks": {i: {"enabled": i == "gradient_mismatch"} for i in PROBES}}
    (record,) = gradwatch.probe(model, batch, _ce, config=cfg).probes
    return record


@pytest.mark.floor
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_wrong_backward_under_opacus_is_still_found() -> None:
    """The copy keeps opacus's per-parameter attributes (``_forward_counter``), so the probe
    now evaluates a GradSampleModule at all: a wrong derivative inside one is a finding."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = opacus.GradSampleModule(nn.Sequential(nn.Linear(6, 16), _Wrong(), nn.Linear(16, 3)))
    batch = (torch.randn(8, 6, generator=_gen(0)), torch.randint(0, 3, (8,), generator=_gen(1)))
    record = _gradient_only(model, batch)
    assert record.verdict == "finding"
    assert [r.name for r in record.layers if r.status == "mismatch"] == ["_module.0"]
    assert all(p._forward_counter == 0 for p in model.parameters())  # the user's, untouched


class _LazyStat(nn.Module):
    """A buffer that the first forward sizes, as a per-channel observer's ``min_val``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.empty(0))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            peak = x.detach().abs().amax(0)
            if self.peak.numel() == 0:
                self.peak.resize_(peak.shape)
                self.peak.copy_(peak)
            else:
                self.peak.copy_(torch.maximum(self.peak, peak))
        return x


def test_a_wrong_backward_beside_a_buffer_the_forward_sizes_is_still_found() -> None:
    torch.manual_seed(0)
    batch = (torch.randn(8, 4, generator=_gen(0)), torch.randint(0, 3, (8,), generator=_gen(1)))
    right = nn.Sequential(nn.Linear(4, 16), _LazyStat(), nn.Tanh(), nn.Linear(16, 3))
    assert _gradient_only(right, batch).verdict == "passed"
    wrong = nn.Sequential(nn.Linear(4, 16), _LazyStat(), _Wrong(), nn.Linear(16, 3))
    record = _gradient_only(wrong, batch)
    assert record.verdict == "finding"
    assert [r.name for r in record.layers if r.status == "mismatch"] == ["0"]


class _QatBody(_QatNet):
    """The QAT net with a float tail (``qconfig = None``: no fake quantisation downstream of
    ``mid``, so nothing explains it) behind a wrong backward."""

    def __init__(self) -> None:
        super().__init__()
        self.mid, self.wrong, self.head = nn.Linear(10, 16), _Wrong(), nn.Linear(16, 10)
        self.mid.qconfig = self.head.qconfig = None

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.wrong(self.mid(super().forward(x))))


@QUANT[0]
@QUANT[1]
def test_a_wrong_backward_after_the_fake_quantised_layers_is_still_found() -> None:
    torch.manual_seed(0)
    record = _gradient_only(_prepared(_QatBody()), _images(size=8))
    assert record.verdict == "finding"
    status = {r.name: r.status for r in record.layers}
    assert (status.pop("mid"), status.pop("head")) == ("mismatch", "agree")
    assert set(status.values()) == {"explained"}
