"""``sample_weight_depends_on_split``'s probe: the whole batch's gradient against its halves'.

Violating forms (practitioners' reports), each a ``loss_fn`` that divides a micro-batch by what
it holds, so accumulating it with ``loss / k`` weighs elements by the split: a token-level
language-model loss over right-padded sequences (the transformers gradient-accumulation bug
of 2024), a hand-written masked mean over an ASR / seq2seq frame mask (``(l * m).sum() /
m.sum()``: no torch loss call for the runtime part to read), a class-weighted cross entropy
(``weight=``: its mean divides by the batch's summed class weights, forum threads on weighted
losses and accumulation), and segmentation's per-pixel loss with ``ignore_index=255`` over
images with different void areas. Look-alikes, silent: a per-sample mean, the token sum
divided by a fixed total count (``num_items_in_batch``), a per-sequence mean averaged over
the batch, a model with dropout and batch norm (judged in eval mode); not judged: a
contrastive loss (it couples samples), a one-parameter model (halves' gradients parallel).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, verdicts
from torch import Tensor, nn

import gradwatch
from gradwatch.probes import PROBES

CHECK = "sample_weight_depends_on_split"
VOCAB, LENGTHS = 40, (12, 12, 11, 10, 4, 3, 2, 2)


def _cfg(accumulation: Optional[int]) -> dict[str, Any]:
    checks: dict[str, Any] = {i: {"enabled": i == CHECK} for i in PROBES}
    checks[CHECK]["accumulation_steps"] = accumulation
    return {"checks": checks}


def _probe(model: nn.Module, batch: Any, loss_fn: Any, accumulation: Optional[int] = 4) -> Any:
    return gradwatch.probe(model, batch, loss_fn, config=_cfg(accumulation))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.mix = nn.GRU(16, 16, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.drop(self.mix(self.embed(ids))[0]))


def _padded(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded token ids (long sequences first, as a length-sorted bucket), next-token
    labels with -100 on padding, and the mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]
    ids = ids * mask
    labels = ids.masked_fill(~mask, -100)
    return ids, labels, mask


def lm_token_mean(m: nn.Module, b: Any) -> Tensor:
    ids, labels, _ = b
    return F.cross_entropy(m(ids).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def masked_mean_by_hand(m: nn.Module, b: Any) -> Tensor:
    ids, labels, mask = b
    per_token = F.cross_entropy(
        m(ids).reshape(-1, VOCAB), labels.clamp(min=0).reshape(-1), reduction="none"
    ).reshape(ids.shape)
    return (per_token * mask).sum() / mask.sum()


def per_sequence_mean(m: nn.Module, b: Any) -> Tensor:
    ids, labels, mask = b
    per_token = F.cross_entropy(
        m(ids).reshape(-1, VOCAB), labels.clamp(min=0).reshape(-1), reduction="none"
    ).reshape(ids.shape)
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def token_sum_over_total(m: nn.Module, b: Any) -> Tensor:
    ids, labels, _ = b
    logits = m(ids).reshape(-1, VOCAB)
    total = sum(LENGTHS)  # the step's count, summed over its micro-batches beforehand
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum") / total


def _segmentation() -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    images = torch.randn(8, 3, 12, 12)
    masks = torch.randint(0, 4, (8, 12, 12))
    masks[:4, :, 2:] = 255  # the first half: mostly void (crops past the image's border)
    return model, (images, masks)


def seg_loss(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1], ignore_index=255)


def _weighted() -> tuple[nn.Module, tuple[Tensor, Tensor], Any]:
    x, _ = data(16)
    y = torch.cat([torch.zeros(8, dtype=torch.long), torch.randint(1, 10, (8,))])  # rare class 0
    weight = torch.ones(10)
    weight[0] = 20.0

    def loss_fn(m: nn.Module, b: Any) -> Tensor:
        return F.cross_entropy(m(b[0]), b[1], weight=weight)

    return mlp(), (x, y), loss_fn


@pytest.mark.parametrize(
    "form",
    ["lm_token_mean", "masked_mean_by_hand", "class_weighted", "segmentation_void"],
)
def test_a_loss_that_divides_each_micro_batch_by_what_it_holds_is_caught(form: str) -> None:
    if form == "class_weighted":
        model, batch, loss_fn = _weighted()
    elif form == "segmentation_void":
        model, batch = _segmentation()
        loss_fn = seg_loss
    else:
        model, batch = TinyLM(), _padded()
        loss_fn = lm_token_mean if form == "lm_token_mean" else masked_mean_by_hand
    report = _probe(model, batch, loss_fn)
    (found,) = findings(report, CHECK)
    assert found.severity == "warning" and found.details["ratio"] > 1.5, found.message
    assert "accumulation" in found.message and found.params  # the model's trainable params


def test_token_counts_give_the_halves_weights() -> None:
    report = _probe(TinyLM(), _padded(), lm_token_mean)
    (found,) = findings(report, CHECK)
    first, second = sum(LENGTHS[:4]), sum(LENGTHS[4:])
    a, b = found.details["weights"]
    assert a == pytest.approx(first / (first + second), rel=1e-3)
    assert b == pytest.approx(second / (first + second), rel=1e-3)


def test_without_accumulation_the_same_loss_is_only_info() -> None:
    for accumulation in (None, 1):
        report = _probe(TinyLM(), _padded(), lm_token_mean, accumulation)
        (found,) = findings(report, CHECK)
        assert found.severity == "info" and "matters only if" in found.message


@pytest.mark.parametrize("loss_fn", [per_sequence_mean, token_sum_over_total])
def test_a_loss_whose_halves_weigh_alike_passes(loss_fn: Any) -> None:
    report = _probe(TinyLM(), _padded(), loss_fn)
    assert verdicts(report)[CHECK] == "passed" and not findings(report, CHECK)


def test_a_per_sample_mean_with_dropout_and_batch_norm_passes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10)
    )
    report = _probe(model, data(15), ce)  # an odd batch: the halves take 7 samples each
    assert verdicts(report)[CHECK] == "passed"
    assert report.probes[-1].details["residual"] < 1e-4


def test_a_loss_that_couples_samples_is_not_judged() -> None:
    def info_nce(m: nn.Module, b: Any) -> Tensor:
        z = F.normalize(m(b[0]), dim=1)
        logits = z @ z.roll(1, 0).T / 0.1
        return F.cross_entropy(logits, torch.arange(len(z)))

    report = _probe(mlp(), data(16), info_nce)
    assert verdicts(report)[CHECK] == "not_observed"
    assert report.probes[-1].details["reason"] == "coupled"


def test_a_one_parameter_model_is_not_judged() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor(0.5))

        def forward(self, x: Tensor) -> Tensor:
            return self.w * x

    x = torch.randn(8, 3)
    report = _probe(Scale(), (x, 2 * x), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert verdicts(report)[CHECK] == "not_observed"
    assert report.probes[-1].details["reason"] == "parallel"


def test_the_probe_leaves_the_model_and_its_mode_alone() -> None:
    model = TinyLM().train()
    before = [p.detach().clone() for p in model.parameters()]
    _probe(model, _padded(), lm_token_mean)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_watcher_probe_reads_the_accumulation_the_run_showed() -> None:
    model, batch = TinyLM(), _padded()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = {"probes": "off", "checks": {"sample_weight_depends_on_split": {"scan_steps": 0}}}
    with gradwatch.watch(model, opt, config=cfg) as w:
        assert findings(w.probe(batch, lm_token_mean), CHECK)[0].severity == "info"
        for _ in range(2):
            opt.zero_grad()
            for part in (slice(0, 4), slice(4, 8)):  # two micro-batches per step
                (lm_token_mean(model, tuple(t[part] for t in batch)) / 2).backward()
            opt.step()
        (found,) = findings(w.probe(batch, lm_token_mean), CHECK)
    assert found.severity == "warning" and found.details["accumulates"]


def test_a_forward_that_samples_noise_is_not_judged_and_says_why() -> None:
    class Reparam(nn.Module):  # a VAE's encoder: the sample is drawn in eval mode too
        def __init__(self) -> None:
            super().__init__()
            self.mu, self.logvar, self.dec = nn.Linear(4, 2), nn.Linear(4, 2), nn.Linear(2, 4)

        def forward(self, x: Tensor) -> Tensor:
            mu, logvar = self.mu(x), self.logvar(x)
            return self.dec(mu + torch.randn_like(mu) * (0.5 * logvar).exp())

    x, _ = data(16)
    report = _probe(Reparam(), (x,), lambda m, b: F.mse_loss(m(b[0]), b[0]))
    assert verdicts(report)[CHECK] == "not_observed"
    assert report.probes[-1].details["reason"] == "random"
