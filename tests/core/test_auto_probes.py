"""The loss-free probes inside ``watch()`` (issue 48, SPEC 8.3): a plain loop, no code added.

Real loops and models; the bugs are the forms practitioners report (a custom backward with a
missing factor, a softmax over dim 0, a causal mask built with ``triu``), and the clean side
holds the designs that resemble them (batch norm, a padded transformer, an RNN, a CNN).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _threads import one_thread
from torch import Tensor, nn

import gradwatch
import gradwatch.probes.auto as auto
import gradwatch.probes.watched as core_auto
from gradwatch.probes import LOSS_FREE_PROBES

__all__ = ["one_thread"]


# -- models --------------------------------------------------------------------------------


class Square(torch.autograd.Function):
    """``x * x`` with the factor 2 missing from its backward (a hand-written derivative)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return g * x


class WrongBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(Square.apply(self.a(x)))


class BatchSoftmax(nn.Module):
    """Attention weights normalised over the batch: ``softmax(scores, dim=0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(6, 1), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = F.softmax(self.score(x), dim=0)
        return self.head(x * w * x.shape[0])


class TinyLM(nn.Module):
    """A causal self-attention LM; ``upper=True`` builds the mask with ``triu`` flipped."""

    def __init__(self, upper: bool = False, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(8, d) * 0.1)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.out = nn.Linear(d, vocab)
        self.upper = upper

    def forward(self, ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        n = ids.shape[1]
        h = self.emb(ids) + self.pos[:n]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        mask = ~future if self.upper else future  # True: not allowed to attend
        mask = mask & ~torch.eye(n, dtype=torch.bool)
        pad = None if attention_mask is None else attention_mask == 0
        h = h + self.attn(h, h, h, attn_mask=mask, key_padding_mask=pad, need_weights=False)[0]
        return self.out(h)


class CausalSelfAttention(TinyLM):
    """Its class name declares it causal (as minGPT's does)."""


class PositionInBatch(nn.Module):
    """A learned offset per position in the batch: a sample's output depends on its slot."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.slot = nn.Linear(6, 3), nn.Parameter(torch.randn(64, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.slot[: x.shape[0]]


class Encoder(nn.Module):
    """A padded encoder (Hugging Face's convention: attention_mask 1 = keep), mean-pooled
    over the kept positions."""

    def __init__(self, vocab: int = 11, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.enc(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


class RNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 12, batch_first=True), nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


# -- loops ---------------------------------------------------------------------------------


def _vector_batches(n: int = 8) -> Iterator[tuple[Any, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _train(
    model: nn.Module,
    batches: Iterator[tuple[Any, Tensor]],
    steps: int = 3,
    config: Optional[dict[str, Any]] = None,
    loss: Any = None,
) -> gradwatch.Report:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = loss or (lambda out, y: F.cross_entropy(out, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
        with gradwatch.watch(model, opt, config=config) as w:
            for _ in range(steps):
                x, y = next(batches)
                opt.zero_grad()
                out = model(**x) if isinstance(x, dict) else model(x)
                loss(out, y).backward()
                opt.step()
    return w.report()


def _lm_batches(n: int = 6, length: int = 8, padded: bool = False) -> Iterator[Any]:
    gen = torch.Generator().manual_seed(2)
    while True:
        ids = torch.randint(0, 11, (n, length), generator=gen)
        if not padded:
            yield ids, ids
            continue
        mask = torch.ones(n, length, dtype=torch.long)
        mask[::2, length // 2 :] = 0  # every other sample padded at its end
        yield {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (n,), generator=gen)


def _lm_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _failing(report: gradwatch.Report) -> list[tuple[str, str]]:
    return [(f.check, f.message) for f in report.findings if f.severity != "info"]


def _verdicts(report: gradwatch.Report) -> dict[str, str]:
    return {p.id: p.verdict for p in report.probes}


# -- what a plain loop now reports ---------------------------------------------------------


def test_a_wrong_custom_backward_is_found_with_no_code_added() -> None:
    # a preview check (SPEC 8.1): by default its finding is info, kept in the probes' record
    default = _train(WrongBackward(), _vector_batches())
    assert _verdicts(default)["gradient_mismatch"] == "finding"
    assert not default.by_check("gradient_mismatch") and not _failing(default)
    report = _train(WrongBackward(), _vector_batches(), config={"preview": True})
    found = [f for f in report.findings if f.check == "gradient_mismatch"]
    assert found and found[0].severity == "error", report.findings
    assert found[0].module == "a"
    assert found[0].details["custom_functions"] == ["Square"]
    assert _verdicts(report)["gradient_mismatch"] == "finding"


def test_a_softmax_over_the_batch_is_found() -> None:
    report = _train(BatchSoftmax(), _vector_batches())
    found = [f for f in report.findings if f.check == "sample_dependence"]
    assert found and found[0].severity == "error"
    assert found[0].details["independence"] == "batch"


@pytest.mark.parametrize("cls", [CausalSelfAttention])
def test_a_position_that_sees_later_ones_is_found(cls: type) -> None:
    report = _train(cls(upper=True), _lm_batches(), loss=_lm_loss)
    found = [f for f in report.findings if f.check == "sample_dependence"]
    assert found and found[0].details["independence"] == "causal", report.findings


def test_the_same_causal_model_with_its_mask_right_is_clean() -> None:
    report = _train(CausalSelfAttention(), _lm_batches(), loss=_lm_loss)
    assert not _failing(report)
    verdicts = _verdicts(report)
    assert verdicts["sample_dependence"] == "passed" and verdicts["gradient_mismatch"] == "passed"
    assert "finding" not in verdicts.values(), verdicts


@pytest.mark.skipif(
    "batch_order_dependent" not in LOSS_FREE_PROBES, reason="the batch-order probe is not here"
)
def test_a_sample_whose_output_depends_on_its_slot_in_the_batch_is_found() -> None:
    report = _train(PositionInBatch(), _vector_batches())
    assert any(f.check == "batch_order_dependent" for f in report.findings), report.findings


@pytest.mark.parametrize(
    ("make", "batches", "loss"),
    [
        (mlp, _vector_batches, None),
        (RNN, lambda: ((torch.randn(8, 5, 6), y) for _, y in _vector_batches()), None),
        (cnn, lambda: ((torch.randn(8, 3, 6, 6), y) for _, y in _vector_batches()), None),
        (Encoder, lambda: _lm_batches(padded=True), None),
    ],
    ids=["mlp", "rnn", "cnn_batchnorm", "padded_encoder"],
)
def test_correct_models_stay_clean(make: Any, batches: Any, loss: Any) -> None:
    torch.manual_seed(0)
    report = _train(make(), batches(), loss=loss)
    assert not _failing(report), _failing(report)
    verdicts = _verdicts(report)
    assert set(verdicts) == set(LOSS_FREE_PROBES)
    assert verdicts["gradient_mismatch"] == "passed", report.probes
    # batch norm couples the samples: said as info, not as a failure
    assert verdicts["sample_dependence"] == "passed" or make is cnn


def test_the_padding_is_judged_through_the_keyword_call() -> None:
    report = _train(Encoder(), _lm_batches(padded=True))
    record = next(p for p in report.probes if p.id == "sample_dependence")
    assert record.details["declared"]["padding"] == "the batch's attention_mask"
    assert "not_judged" not in record.details


# -- what is never touched -----------------------------------------------------------------


def _rng_draws() -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(np.random.rand())


def _seeded_run(probes: str) -> tuple[nn.Module, torch.optim.Optimizer, list[Tensor], Any]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    kept = [x.clone() for x, _ in data]
    with gradwatch.watch(model, opt, config={"probes": probes}) as w:
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert all(torch.equal(x, k) for (x, _), k in zip(data, kept)), "the batch was changed"
    return model, opt, [p.grad.clone() for p in model.parameters()], (_rng_draws(), w.report())


def test_weights_grads_optimizer_rng_and_data_are_untouched() -> None:
    """The same seeded loop with the probes on and off ends in the same state: the probes
    drew no random number of the user's, moved no weight, wrote no ``.grad``, no optimizer
    state (dropout in the model draws from the global generator at every step)."""
    m_on, opt_on, grads_on, (draws_on, report_on) = _seeded_run("on")
    m_off, opt_off, grads_off, (draws_off, report_off) = _seeded_run("off")
    assert report_on.probes and not report_off.probes
    for a, b in zip(m_on.parameters(), m_off.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    for sa, sb in zip(opt_on.state.values(), opt_off.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert draws_on == draws_off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_generator_is_untouched() -> None:
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6, device="cuda"), torch.randint(0, 3, (8,), device="cuda")
    with gradwatch.watch(model, opt) as w:
        F.cross_entropy(model(x), y).backward()
        before = torch.cuda.get_rng_state()
        opt.step()  # the probes run here
        assert torch.equal(torch.cuda.get_rng_state(), before)
    assert w.report().probes


def test_a_batch_changed_in_place_after_its_forward_is_not_probed() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with gradwatch.watch(model, opt) as w:
        F.cross_entropy(model(x), y).backward()
        x.mul_(2.0)  # the loader's buffer refilled, or a hand-made augmentation
        opt.step()
    report = w.report()
    assert not report.probes
    said = [f for f in report.findings if f.check == "not_observed"]
    assert [f.details["reason"] for f in said] == ["probes_batch_changed"]
    assert said[0].severity == "info"


# -- when they run, and what they cost ----------------------------------------------------


def test_off_runs_nothing_and_the_report_says_nothing() -> None:
    report = _train(BatchSoftmax(), _vector_batches(), config={"probes": "off"})
    assert not report.probes
    assert not [f for f in report.findings if f.check == "sample_dependence"]


def test_auto_skips_a_model_over_the_size_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auto, "MAX_PARAMS", 10)
    report = _train(BatchSoftmax(), _vector_batches(), steps=3)
    said = [f for f in report.findings if f.check == "not_observed"]
    assert len(said) == 1 and said[0].severity == "info"
    assert said[0].details["reason"] == "probes_model_too_large"
    assert not report.probes
    forced = _train(BatchSoftmax(), _vector_batches(), config={"probes": "on"})
    assert any(f.check == "sample_dependence" for f in forced.findings)


def test_no_copy_beyond_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "free_bytes", lambda device: 1000)
    report = _train(mlp(), _vector_batches(), config={"probes": "on"})
    reasons = [f.details["reason"] for f in report.findings if f.check == "not_observed"]
    assert reasons == ["probes_no_memory"]


def test_the_step_waits_once_and_the_cost_is_reported() -> None:
    report = _train(mlp(), _vector_batches(), steps=4)
    assert len(report.probes) == len(LOSS_FREE_PROBES)
    for record in report.probes:
        assert record.seconds > 0
        assert record.details["auto"] is True
        assert record.details["budget_s"] >= auto.MIN_BUDGET_S
        assert record.details["step_seconds"] > 0


def test_without_an_optimizer_they_run_after_the_first_backward() -> None:
    model = BatchSoftmax()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
        with gradwatch.watch(model) as w:
            x = torch.randn(8, 6)
            model(x).sum().backward()
    assert any(f.check == "sample_dependence" for f in w.report().findings)


def test_a_forward_without_grad_first_is_not_the_batch_probed() -> None:
    """A sanity-check pass under no_grad (Lightning's, an eval before training) is skipped:
    the batch probed is the first one the model trains on."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        with torch.no_grad():
            model(torch.randn(1, 6))  # one sample: nothing to judge, were it taken
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        opt.step()
    record = next(p for p in w.report().probes if p.id == "sample_dependence")
    assert record.verdict == "passed" and record.details["batch"] == 8


def test_named_models_are_each_probed_with_their_own_batch() -> None:
    gen, disc = nn.Sequential(nn.Linear(4, 6)), BatchSoftmax()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
        with gradwatch.watch({"G": gen, "D": disc}, {"G": opt_g, "D": opt_d}) as w:
            for _ in range(2):
                fake = gen(torch.randn(8, 4))
                opt_d.zero_grad()
                disc(fake.detach()).sum().backward()
                opt_d.step()
                opt_g.zero_grad()
                disc(fake).sum().backward()
                opt_g.step()
    report = w.report()
    assert {p.details["model"] for p in report.probes} == {"G", "D"}
    found = [f for f in report.findings if f.check == "sample_dependence"]
    assert [f.details["model"] for f in found] == ["D"]


def test_a_child_called_on_its_own_is_probed() -> None:
    """A LightningModule's ``training_step`` calls ``self.net(x)``, never ``self(x)``."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = BatchSoftmax()

    model = Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradwatch.GradWatchWarning)
        with gradwatch.watch(model, opt) as w:
            model.net(torch.randn(8, 6)).sum().backward()
            opt.step()
    assert any(f.check == "sample_dependence" for f in w.report().findings)


# -- faults never reach the training loop --------------------------------------------------


def test_a_probe_that_raises_is_not_observed_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(auto, "run_probes", broken)
    report = _train(mlp(), _vector_batches(), steps=3)
    assert report.steps == 3
    # said in the probes section (unasked inside watch(): a record, not a finding)
    assert {p.id for p in report.probes} == set(LOSS_FREE_PROBES)
    assert {p.verdict for p in report.probes} == {"not_observed"}
    assert all("boom" in p.note for p in report.probes)
    assert not [f for f in report.findings if f.check == "not_observed"]


def test_a_fault_in_the_wiring_is_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(core_auto, "run_auto", broken)
    report = _train(mlp(), _vector_batches(), steps=3)
    assert report.steps == 3
    assert [f.details["where"] for f in report.findings if f.check == "internal_error"] == [
        "loss-free probes"
    ]


def test_a_model_that_cannot_be_copied_is_said_not_observed() -> None:
    import threading

    model = mlp()
    model.lock = threading.Lock()  # type: ignore[assignment]  # deepcopy refuses it
    report = _train(model, _vector_batches(), steps=2)
    reasons = {p.details.get("reason") for p in report.probes}
    assert reasons == {"not_copyable"}, report.probes
    assert not _failing(report)


def test_the_gradient_probe_takes_two_samples_unless_told() -> None:
    def samples(config: Optional[dict[str, Any]]) -> Any:
        report = _train(mlp(), _vector_batches(), config=config)
        (record,) = [p for p in report.probes if p.id == "gradient_mismatch"]
        assert record.verdict == "passed", record.note
        return record.details["samples"]

    assert samples(None) == auto.GRADIENT_SAMPLES == 2  # of the batch's 8
    assert samples({"checks": {"gradient_mismatch": {"max_samples": 8}}}) == 8
