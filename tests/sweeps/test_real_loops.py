"""No false alarms on real architectures and optimizers, and no change to what they train.

Each case is a short, correct training loop of a kind users run: PEFT adapters (LoRA,
prefix tuning) on tiny transformers models built from configs, and plain models with
parametrizations, pruning and the optimizers/schedulers/EMA whose bookkeeping is unusual
(fused and foreach kernels, Adagrad, Rprop, AMSGrad, OneCycleLR, ``AveragedModel``).
Gradwatch must stay silent on them (``info`` findings allowed) and must not change training:
the ground truth is the same run, built from the same seed, without ``watch()``; both runs'
losses must be equal. So that these tests can fail, most cases have a "bug twin": the same
loop with one real bug planted the way a user would write it, which gradwatch must name by
check id and parameter names.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.utils.parametrizations as parametrizations
import torch.nn.utils.prune as prune
from _architectures import ARCHITECTURES
from torch import nn
from torch.optim.swa_utils import AveragedModel

import gradwatch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# peft adapters on transformers models: their module layout is what gradwatch watches.
pytestmark = pytest.mark.floor

Batch = Any  # a dict of tensors (transformers) or an (x, y) pair (plain models)
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
SEED = 0
VOCAB = 64
_STRICT = ("warning", "error")


@dataclass
class Loop:
    """One training loop: what to build once and how each step runs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[Batch]
    loss: LossFn
    after_step: Callable[[], None] = lambda: None  # scheduler.step(), EMA update
    config: dict[str, Any] = field(default_factory=lambda: {"every_n_steps": 1})
    zero_grad_until: Optional[int] = None  # a bug twin stops calling zero_grad() at this step
    steps_per_backward: int = 1  # a bug twin calls step() twice


@dataclass(frozen=True)
class Bug:
    """What a bug twin must produce: a finding of ``check`` naming exactly ``params``."""

    check: str
    params: frozenset[str]
    cause: Optional[str] = None  # ``details.cause``, where the check gives one
    first_step: Optional[int] = None  # for a bug that starts late


@dataclass(frozen=True)
class Case:
    """A correct loop (``build``), its bug twin (``plant``) and what else it may report."""

    build: Callable[[], Loop]
    plant: Optional[Callable[[Loop], Bug]] = None  # turns the built loop into its bug twin
    expect_info: frozenset[str] = frozenset()  # info findings the correct loop must produce
    marks: tuple[pytest.MarkDecorator, ...] = ()


def _params(cases: dict[str, Case], *, twins: bool = False) -> list[Any]:
    return [
        pytest.param(case, id=name, marks=case.marks)
        for name, case in cases.items()
        if case.plant is not None or not twins
    ]


def run(loop: Loop, *, watched: bool) -> tuple[list[float], Optional[gradwatch.Report]]:
    """Run ``loop``, under ``watch()`` or not, returning its losses (and the report)."""
    ctx: Any = (
        gradwatch.watch(loop.model, loop.optimizer, config=loop.config)
        if watched
        else contextlib.nullcontext()
    )
    losses: list[float] = []
    with ctx as watcher:
        for step, batch in enumerate(loop.batches):
            if loop.zero_grad_until is None or step < loop.zero_grad_until:
                loop.optimizer.zero_grad()
            loss = loop.loss(loop.model, batch)
            loss.backward()
            for _ in range(loop.steps_per_backward):
                loop.optimizer.step()
            loop.after_step()
            losses.append(loss.item())
    return losses, (watcher.report() if watched else None)


def build(case: Case) -> Loop:
    # Seeded here, not in the builders: both runs of a case start from the same global RNG
    # state, so weights, peft's adapter init and LoRA dropout masks are identical.
    torch.manual_seed(SEED)
    return case.build()


# --- PEFT on tiny transformers models --------------------------------------------------------
def _tokens(steps: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


def _lm_batches() -> list[Batch]:
    return [{"input_ids": t, "labels": t} for t in _tokens()]


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _peft(base: nn.Module, cfg: Any) -> nn.Module:
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 a deprecated question while wrapping.
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        return peft.get_peft_model(base, cfg)


def _adamw(model: nn.Module, *, everything: bool = False) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if everything or p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-3)


def _gpt2() -> nn.Module:
    return ARCHITECTURES["gpt2"]()[0]  # the suite's tiny models (tests/_helpers/_architectures.py)


def _gpt2_lora(everything: bool = False) -> Loop:
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = _peft(_gpt2(), lora)
    return Loop(model, _adamw(model, everything=everything), _lm_batches(), _hf_loss)


def _llama_lora() -> Loop:
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = _peft(ARCHITECTURES["llama"]()[0], lora)
    return Loop(model, _adamw(model), _lm_batches(), _hf_loss)


def _bert_lora_cls() -> Loop:
    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    # SEQ_CLS puts the classifier in modules_to_save: a trainable copy next to the frozen,
    # never-called original, which must not read as a ghost.
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    model = _peft(transformers.BertForSequenceClassification(cfg), lora)
    labels = torch.tensor([0, 1])
    batches = [{"input_ids": t, "labels": labels} for t in _tokens()]
    return Loop(model, _adamw(model), batches, _hf_loss)


def _t5_lora() -> Loop:
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_2_SEQ_LM, r=4, target_modules=["q", "v"])
    model = _peft(ARCHITECTURES["t5"]()[0], lora)
    return Loop(model, _adamw(model), _lm_batches(), _hf_loss)


def _gpt2_lora_checkpointed() -> Loop:
    # Reentrant checkpointing, the classic PEFT trap: it works only because transformers
    # makes the embeddings' output require grad; each block's forward runs twice.
    loop = _gpt2_lora()
    model: Any = loop.model  # a PeftModel: forwards to the transformers model
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    return loop


def _gpt2_lora_reference_pass() -> Loop:
    # DPO-style: a reference forward of the same model with the adapters off, under no_grad,
    # then the policy forward. Adapters run twice per step, once without grad.
    loop = _gpt2_lora()

    def loss(model: Any, batch: Batch) -> torch.Tensor:  # a PeftModel
        with torch.no_grad(), model.disable_adapter():
            reference = model(**batch).loss
        return model(**batch).loss - reference

    loop.loss = loss
    return loop


def _gpt2_prefix() -> Loop:
    prefix = peft.PrefixTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4)
    model = _peft(_gpt2(), prefix)
    return Loop(model, _adamw(model), _lm_batches(), _hf_loss)


def _skip_first_adapter(loop: Loop) -> Bug:
    """A custom forward on one LoRA layer that calls only the frozen base layer."""
    name, layer = next(
        (n, m) for n, m in loop.model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)
    )
    layer.forward = layer.base_layer.forward  # type: ignore[method-assign]
    skipped = {f"{name}.{n}" for n, p in layer.named_parameters() if p.requires_grad}
    assert skipped and all("lora_" in n for n in skipped), skipped
    return Bug("ghost_param", frozenset(skipped), cause="not_called")


def _unused_head(loop: Loop) -> Bug:
    """A head added to the model and its optimizer that the forward never calls."""
    loop.model.extra_head = nn.Linear(32, 2)
    loop.optimizer.add_param_group({"params": list(loop.model.extra_head.parameters())})
    return Bug("ghost_param", frozenset({"extra_head.weight", "extra_head.bias"}), "not_called")


_PAST_KV = pytest.mark.filterwarnings(  # prefix tuning passes past_key_values, deprecated in 5.x
    "ignore:`past_key_values` is deprecated:FutureWarning"
)

PEFT_CASES = {
    "gpt2-lora": Case(_gpt2_lora, _skip_first_adapter),
    "gpt2-lora-whole-model-in-optimizer": Case(
        lambda: _gpt2_lora(everything=True),
        _skip_first_adapter,
        expect_info=frozenset({"frozen_in_optimizer"}),
    ),
    "gpt2-lora-reentrant-checkpointing": Case(_gpt2_lora_checkpointed, _skip_first_adapter),
    "gpt2-lora-reference-pass": Case(_gpt2_lora_reference_pass, _skip_first_adapter),
    "llama-lora-dropout": Case(_llama_lora, _skip_first_adapter),
    "bert-lora-seq-cls": Case(_bert_lora_cls, _skip_first_adapter),
    "t5-lora": Case(_t5_lora, _skip_first_adapter),
    "gpt2-prefix": Case(_gpt2_prefix, _unused_head, marks=(_PAST_KV,)),
}


# --- plain models: parametrizations, pruning, optimizers, schedulers, EMA -------------------
def _xy(steps: int = 8) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)
    ]


def _mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _with(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer], steps: int = 8, **kw: Any
) -> Callable[[], Loop]:
    def make() -> Loop:
        model = _mlp()
        return Loop(model, make_opt(model), _xy(steps), _mse, **kw)

    return make


def _parametrized() -> Loop:
    model = nn.Sequential(
        parametrizations.weight_norm(nn.Linear(8, 16)),
        nn.ReLU(),
        parametrizations.spectral_norm(nn.Linear(16, 4)),
    )
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-2), _xy(), _mse)


def _pruned() -> Loop:
    model = _mlp()
    prune.l1_unstructured(model[0], "weight", amount=0.5)  # weight_orig * weight_mask
    return Loop(model, torch.optim.SGD(model.parameters(), lr=1e-2), _xy(), _mse)


def _one_cycle() -> Loop:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8)
    return Loop(model, opt, _xy(), _mse, after_step=sched.step)


def _ema() -> Loop:
    model = _mlp()
    ema = AveragedModel(model)  # a deep copy whose parameters still require grad
    x = torch.randn(16, 8)

    def after_step() -> None:
        ema.update_parameters(model)
        ema(x)  # evaluated every step, as in the hand-run sweep

    return Loop(model, torch.optim.SGD(model.parameters(), lr=1e-2), _xy(), _mse, after_step)


def _everything(model: nn.Module) -> frozenset[str]:
    return frozenset(n for n, p in model.named_parameters() if p.requires_grad)


def _no_zero_grad(loop: Loop) -> Bug:
    loop.zero_grad_until = 0
    return Bug("missing_zero_grad", _everything(loop.model))


def _no_zero_grad_after_hooks_trimmed(loop: Loop) -> Bug:
    # Past trim_hooks_after (8) and a statistics step (10): a bug that starts late.
    loop.zero_grad_until = 12
    return Bug("missing_zero_grad", _everything(loop.model), first_step=12)


def _step_twice(loop: Loop) -> Bug:
    loop.steps_per_backward = 2
    return Bug("double_update", _everything(loop.model))


def _optimizer_of_first_layer_only(loop: Loop) -> Bug:
    assert isinstance(loop.model, nn.Sequential)
    loop.optimizer = torch.optim.Adam(loop.model[0].parameters(), lr=1e-2)
    return Bug("not_in_optimizer", frozenset({"2.bias", "2.parametrizations.weight.original"}))


MISC_CASES = {
    "weight-norm-spectral-norm": Case(_parametrized, _optimizer_of_first_layer_only),
    "l1-unstructured-prune": Case(_pruned),
    "fused-adamw": Case(
        _with(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)), _no_zero_grad
    ),
    "foreach-nesterov-sgd": Case(
        _with(
            lambda m: torch.optim.SGD(
                m.parameters(), lr=1e-2, momentum=0.9, nesterov=True, foreach=True
            )
        ),
        _step_twice,
    ),
    "adagrad": Case(_with(lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2))),
    "rprop": Case(_with(lambda m: torch.optim.Rprop(m.parameters(), lr=1e-2))),
    "amsgrad-default-cadence": Case(
        _with(
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True),
            steps=25,
            config={},  # defaults: statistics every 10 steps, hooks trimmed after 8
        ),
        _no_zero_grad_after_hooks_trimmed,
    ),
    "one-cycle-lr": Case(_one_cycle),
    "averaged-model-ema": Case(_ema),
}
CASES = {**PEFT_CASES, **MISC_CASES}


# --- the tests --------------------------------------------------------------------------------
def _lines(report: gradwatch.Report) -> list[str]:
    return [f"{f.line()} [{', '.join(f.params[:6])}]" for f in report.findings]


def _frozen(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def _assert_no_frozen_ghosts(report: gradwatch.Report, model: nn.Module) -> None:
    named = {p for f in report.by_check("ghost_param") for p in f.params}
    assert not named & _frozen(model), sorted(named & _frozen(model))[:6]


@pytest.mark.parametrize("case", _params(CASES))
def test_correct_loop_is_silent_and_trains_as_unwatched(case: Case) -> None:
    plain = build(case)
    want, _ = run(plain, watched=False)
    loop = build(case)
    got, report = run(loop, watched=True)
    assert report is not None

    assert report.steps == len(loop.batches) and not report.failed, _lines(report)
    assert [f for f in report.findings if f.severity in _STRICT] == [], _lines(report)
    assert {f.check for f in report.findings} == case.expect_info, _lines(report)
    # gradwatch only observes: bit-for-bit the same losses and the same trained weights.
    # (Every PEFT case has dropout on: drawing from the global RNG would show here too.)
    assert got == want
    trained = dict(plain.model.named_parameters())
    changed = [n for n, p in loop.model.named_parameters() if not torch.equal(p, trained[n])]
    assert changed == []
    if _frozen(loop.model):  # PEFT: frozen base weights are no ghosts
        assert report.coverage.frozen == len(_frozen(loop.model))
        _assert_no_frozen_ghosts(report, loop.model)


@pytest.mark.parametrize("case", _params(CASES, twins=True))
def test_bug_twin_is_named(case: Case) -> None:
    loop = build(case)
    assert case.plant is not None
    bug = case.plant(loop)
    _, report = run(loop, watched=True)
    assert report is not None

    hits = [f for f in report.by_check(bug.check) if f.severity in _STRICT]
    assert hits, _lines(report)
    named = {p for f in hits for p in f.params}
    assert named == bug.params, _lines(report)
    if bug.cause is not None:
        assert {f.details.get("cause") for f in hits} == {bug.cause}, _lines(report)
    if bug.first_step is not None:
        assert min(f.first_step for f in hits) == bug.first_step, _lines(report)
    _assert_no_frozen_ghosts(report, loop.model)
