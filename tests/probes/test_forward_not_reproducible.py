"""``forward_not_reproducible``: three ways a forward reads what an earlier one left (from
practitioners' reports), and the correct designs that resemble them."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from _probe_models import ce, data, findings, mlp, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "forward_not_reproducible"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any = ce, **cfg: Any) -> gradwatch.Report:
    config = {"checks": {**CFG["checks"], CHECK: {"enabled": True, **cfg}}}
    return gradwatch.probe(model, batch, loss_fn, config=config)


class KeptHidden(nn.Module):
    """fast.ai's LMModel5 layout used on independent batches: ``self.h = h.detach()``."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__()
        self.rnn, self.head, self.reset = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 10), reset
        self.h: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        h0 = None if self.reset else self.h
        out, h = self.rnn(x, h0)
        self.h = h.detach()
        return self.head(out[:, -1])


class AnnealedInForward(nn.Module):
    """A Gumbel-softmax temperature annealed by the forward itself, once per call: the
    output depends on how many forwards ran before (validation ones included)."""

    def __init__(self, anneal: bool = True) -> None:
        super().__init__()
        self.embed, self.head, self.anneal = nn.Embedding(12, 8), nn.Linear(8, 10), anneal
        self.tau = 1.0

    def forward(self, ids: Tensor) -> Tensor:
        if self.anneal and self.training:
            self.tau = max(0.5, self.tau * 0.9)
        weights = torch.softmax(self.embed(ids).sum(-1) / self.tau, dim=1)
        return self.head((self.embed(ids) * weights[..., None]).sum(1))


class RunningNorm(nn.Module):
    """A hand-written norm that normalises by running statistics updated in place first."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.var.mul_(0.9).add_(0.1 * x.var(0))
        return (x - self.mean) / (self.var + 1e-5).sqrt()


def _seqs() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, 4, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def _ids() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 12, (8, 6), generator=gen)
    ids[::2, 4:] = 0
    return ids, torch.randint(0, 10, (8,), generator=gen)


def _running_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), RunningNorm(16), nn.ReLU(), nn.Linear(16, 10))


@pytest.mark.parametrize(
    "make, batch, read",
    [
        (KeptHidden, _seqs, ["h"]),
        (AnnealedInForward, _ids, ["tau"]),
        (_running_norm, data, ["1.mean", "1.var"]),
    ],
)
def test_state_left_by_an_earlier_forward_is_found(make: Any, batch: Any, read: list[str]) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch())
    (finding,) = findings(report, CHECK)
    assert finding.severity == "warning"
    assert finding.details["read"] == read and set(read) <= set(finding.details["state"])
    assert verdicts(report) == {CHECK: "finding"}


class EmaTeacher(nn.Module):
    """An EMA of the weights kept in buffers the output does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
        self.register_buffer("ema", torch.zeros(10, 16))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        with torch.no_grad():
            self.ema.mul_(0.99).add_(0.01 * self.net[3].weight)
        return self.net(x)


class KvCache(nn.Module):
    """A decoder that appends to a key/value cache on purpose (generation)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(4, 8), nn.Linear(8, 10)
        self.kv_cache: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        k = self.proj(x)
        self.kv_cache = k.detach() if self.kv_cache is None else self.kv_cache + k.detach()
        return self.head(k + self.kv_cache)


class OwnGenerator(nn.Module):
    """Noise drawn from a ``torch.Generator`` the module holds (a seeded stream of its own):
    random, as dropout is, not state; ``keep`` also keeps a sum of the inputs (the bug)."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(7)
        self.a, self.b, self.keep = nn.Linear(4, 16), nn.Linear(16, 10), keep
        self.seen: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x)) + 0.1 * torch.randn(x.shape[0], 16, generator=self.gen)
        if self.keep:
            self.seen = h.detach() if self.seen is None else self.seen + h.detach()
            h = h + self.seen
        return self.b(h)


def test_a_modules_own_generator_is_seeded_alike_and_the_rest_judged() -> None:
    """Both forwards draw the same noise: the generator is set back, as the global ones are
    seeded; state kept beside it is still found, and only it is named."""
    torch.manual_seed(0)
    assert verdicts(_probe(OwnGenerator(), data())) == {CHECK: "passed"}
    (finding,) = findings(_probe(OwnGenerator(keep=True), data()), CHECK)
    assert finding.details["read"] == ["seen"] and "gen" not in finding.details["state"]


@pytest.mark.parametrize(
    "make, batch",
    [
        (lambda: KeptHidden(reset=True), _seqs),
        (lambda: AnnealedInForward(anneal=False), _ids),
        (EmaTeacher, data),
        (lambda: nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 10)), data),
        (mlp, data),
    ],
)
def test_correct_designs_that_resemble_them_pass(make: Any, batch: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch())
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].details


def test_batch_norm_statistics_change_but_are_not_blamed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 10))
    report = _probe(model, data())
    assert verdicts(report) == {CHECK: "passed"} and report.probes[0].details["state"] == []
    ema = _probe(EmaTeacher(), data())  # listed, but not read by the output
    assert set(ema.probes[0].details["state"]) == {"calls", "ema"}


def test_state_carried_on_purpose_is_said_not_judged() -> None:
    torch.manual_seed(0)
    tbptt = _probe(KeptHidden(), _seqs(), stateful=True)
    assert verdicts(tbptt) == {CHECK: "not_observed"} and "stateful" in tbptt.probes[0].note
    (said,) = findings(tbptt, "not_observed")
    assert said.severity == "info" and said.details["probe"] == CHECK
    allowed = _probe(KeptHidden(), _seqs(), allow=["h"])
    assert verdicts(allowed) == {CHECK: "not_observed"}
    cache = _probe(KvCache(), data())  # recognised by its name
    assert verdicts(cache) == {CHECK: "not_observed"}
    assert "kv_cache" in cache.probes[0].details["declared"]
    assert verdicts(_probe(KvCache(), data(), stateful=False)) == {CHECK: "finding"}


def test_the_copy_is_probed_not_the_model() -> None:
    model = KeptHidden()
    _probe(model, _seqs())
    assert model.h is None


def test_loss_free_with_a_projection_loss() -> None:
    torch.manual_seed(0)
    weight = torch.randn(10)
    report = _probe(KeptHidden(), _seqs(), lambda m, b: F.tanh(m(b[0]) @ weight).sum())
    assert verdicts(report) == {CHECK: "finding"}


class Taps(nn.Module):
    """Feature taps appended to a list by the forward, and a mask made once and reused
    (``if not hasattr``): state restored between forwards must keep them working."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 10)
        self.taps: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        if not hasattr(self, "scale"):
            self.scale = torch.ones(16)
        h = torch.relu(self.a(x)) * self.scale
        self.taps.append(h.detach())
        return self.b(h)


def test_state_the_forward_creates_is_restored_as_absent() -> None:
    torch.manual_seed(0)
    for check in (CHECK, "batch_order_dependent"):
        config = {"checks": {i: {"enabled": i == check} for i in CFG["checks"]}}
        report = gradwatch.probe(Taps(), data(), ce, config=config)
        assert verdicts(report) == {check: "passed"}, report.probes[0].note


def test_state_re_estimated_by_design_is_set_back_and_the_rest_judged() -> None:
    """Spectral norm's power iteration moves ``weight_u`` at every train-mode forward and
    the output reads it (SN-GAN's discriminator): set back, the property still holds."""
    torch.manual_seed(0)
    sn = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 16)), nn.ReLU(), nn.Linear(16, 10))
    report = _probe(sn, data())
    assert verdicts(report) == {CHECK: "passed"}
    assert report.probes[0].details["reset"] == ["0.weight_u", "0.weight_v"]
    torch.manual_seed(0)
    para = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 16)), nn.ReLU())
    assert verdicts(_probe(para, data(), lambda m, b: m(b[0]).sum())) == {CHECK: "passed"}
    bug = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 16)), RunningNorm(16))
    (finding,) = findings(_probe(bug, data(), lambda m, b: m(b[0]).sum()), CHECK)
    assert finding.details["read"] == ["1.mean", "1.var"]
