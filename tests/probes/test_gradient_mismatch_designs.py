"""``gradient_mismatch`` on correct designs whose gradient is not the forward's derivative by
torch's documentation or by declaration (padding rows, gradient reversal, straight-through
estimators under any name), each beside the bug that must still be an error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import Swish, findings, only, verdicts
from torch import Tensor, nn

import gradwatch

CHECK = "gradient_mismatch"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any) -> gradwatch.Report:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return gradwatch.probe(model, batch, loss_fn, opt, config=CFG)


def _passes(report: gradwatch.Report) -> None:
    assert not findings(report, CHECK), findings(report, CHECK)[0].message
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].note


def _error(report: gradwatch.Report) -> gradwatch.Finding:
    (found,) = findings(report, CHECK)
    assert found.severity == "error" and report.failed
    return found


# -- padded text: torch's padding_idx, max_norm, scale_grad_by_freq, sparse ------------------


def padded(n: int = 8, t: int = 12, vocab: int = 50, seed: int = 0) -> tuple[Tensor, ...]:
    """Right-padded token ids (0 is the pad), their lengths and 4-class labels."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, t + 1, (n,), generator=gen)
    ids = torch.randint(1, vocab, (n, t), generator=gen)
    ids[torch.arange(t)[None, :] >= lens[:, None]] = 0
    return ids, lens, torch.randint(0, 4, (n,), generator=gen)


class GRUClassifier(nn.Module):
    """A GRU over the whole padded sequence (no packing), classified from its last state."""

    def __init__(self, **emb: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0, **emb)
        self.gru = nn.GRU(16, 24, batch_first=True)
        self.head = nn.Linear(24, 4)

    def forward(self, ids: Tensor, lens: Tensor) -> Tensor:
        return self.head(self.gru(self.emb(ids))[1][-1])


class BagOfEmbeddings(nn.Module):
    """fastText-style: the padding row (zeros, no gradient) summed with the tokens."""

    def __init__(self, **emb: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0, **emb)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: Tensor, lens: Tensor) -> Tensor:
        return self.head(self.emb(ids).sum(1) / lens[:, None].to(self.head.weight.dtype))


class EmbeddingBagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 16, mode="sum", padding_idx=0, scale_grad_by_freq=True)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: Tensor, lens: Tensor) -> Tensor:
        return self.head(self.emb(ids))


def text_ce(m: Any, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0], b[1]), b[2])


TEXT = {
    "gru_padding_idx": lambda: GRUClassifier(),
    "bag_padding_idx": lambda: BagOfEmbeddings(),
    "bag_max_norm": lambda: BagOfEmbeddings(max_norm=1.0),
    "bag_scale_grad_by_freq": lambda: BagOfEmbeddings(scale_grad_by_freq=True),
    "bag_sparse": lambda: BagOfEmbeddings(sparse=True),
    "embedding_bag": EmbeddingBagClassifier,
}


@pytest.mark.parametrize("name", sorted(TEXT))
def test_documented_embedding_gradients_agree(name: str) -> None:
    torch.manual_seed(0)
    report = _probe(TEXT[name](), padded(), text_ce)
    _passes(report)


def test_the_padding_row_left_out_is_named_in_the_record() -> None:
    torch.manual_seed(0)
    (record,) = _probe(BagOfEmbeddings(max_norm=1.0), padded(), text_ce).probes
    masked = record.details["masked_rows"]["emb.weight"]
    assert masked["why"] == ["max_norm", "padding_idx"] and masked["rows"] >= 1


class DataEditBag(BagOfEmbeddings):
    """The same bag, whose pooled vector is rescaled through ``.data``: still a bug."""

    def forward(self, ids: Tensor, lens: Tensor) -> Tensor:
        h = self.emb(ids).sum(1)
        h.data = h.data / lens[:, None].to(h.dtype)  # autograd still sees the plain sum
        return self.head(torch.tanh(h))


def test_a_data_edit_behind_a_padded_embedding_is_still_an_error() -> None:
    torch.manual_seed(0)
    found = _error(_probe(DataEditBag(), padded(), text_ce))
    assert "emb" in [row["name"] for row in found.details["layers"]]


# -- custom Functions: declared gradients, measured -------------------------------------------


class GradReverse(torch.autograd.Function):
    """DANN's gradient reversal layer (Ganin & Lempitsky, 2015)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, lambd: float) -> Tensor:
        ctx.lambd = lambd
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return -ctx.lambd * g, None


class HalfReverse(torch.autograd.Function):
    """A reversal whose backward flips the sign of only the first half of the features."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return torch.cat([-g[:, : g.shape[1] // 2], g[:, g.shape[1] // 2 :]], dim=1)


class DANN(nn.Module):
    def __init__(self, reverse: Any = None) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(4, 16), nn.ReLU())
        self.label = nn.Linear(16, 3)
        self.domain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
        self.reverse = reverse or (lambda f: GradReverse.apply(f, 0.5))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f = self.feat(x)
        return self.label(f), self.domain(self.reverse(f))


def domain_batch() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    return x, torch.randint(0, 3, (16,), generator=gen), torch.randint(0, 2, (16,), generator=gen)


def dann_loss(m: Any, b: Any) -> Tensor:
    y, d = m(b[0])
    return F.cross_entropy(y, b[1]) + F.cross_entropy(d, b[2])


def test_a_gradient_reversal_layer_is_explained_with_its_measured_factor() -> None:
    torch.manual_seed(0)
    report = _probe(DANN(), domain_batch(), dann_loss)
    _passes(report)
    (record,) = report.probes
    assert record.details["gradient_surgery"] == {"GradReverse": pytest.approx(-0.5)}
    assert {r.name: r.status for r in record.layers}["feat.0"] == "explained"
    assert "explained" in record.note


def test_a_reversal_with_a_wrong_sign_on_part_is_an_error() -> None:
    torch.manual_seed(0)
    found = _error(_probe(DANN(HalfReverse.apply), domain_batch(), dann_loss))
    assert found.details["custom_functions"] == ["HalfReverse"]


def _ste(name: str, forward: Any, backward: Any) -> Any:
    """A straight-through Function class named ``name`` (the name must not matter)."""
    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


def _sign(ctx: Any, x: Tensor) -> Tensor:
    ctx.save_for_backward(x)
    return torch.sign(x)


def _round(ctx: Any, x: Tensor) -> Tensor:
    ctx.save_for_backward(x)
    return torch.round(x * 4) / 4


def _identity(ctx: Any, g: Tensor) -> Tensor:
    return g


def _clipped(ctx: Any, g: Tensor) -> Tensor:  # BinaryNet's hard-tanh STE
    (x,) = ctx.saved_tensors
    return g * (x.abs() <= 1).to(g.dtype)


STES = {
    "SignSTE": (_sign, _identity),
    "Binarize": (_sign, _clipped),
    "RoundPass": (_round, _identity),
    "Quantize": (_round, _clipped),
}


class STENet(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn
        self.a, self.b, self.c = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(self.fn.apply(self.a(x)))))


def ce(m: Any, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1] % 10)


@pytest.mark.parametrize("name", sorted(STES))
def test_a_straight_through_estimator_is_explained_whatever_its_name(name: str) -> None:
    torch.manual_seed(0)
    report = _probe(STENet(_ste(name, *STES[name])), domain_batch(), ce)
    _passes(report)
    (record,) = report.probes
    assert {r.name: r.status for r in record.layers}["a"] == "explained"
    assert name in record.details["straight_through"] or name in record.details["gradient_surgery"]


def _swish(ctx: Any, x: Tensor) -> Tensor:
    ctx.save_for_backward(x)
    return x * torch.sigmoid(x)


def _swish_half(ctx: Any, g: Tensor) -> Tensor:  # the product rule's second term forgotten
    (x,) = ctx.saved_tensors
    return g * torch.sigmoid(x)


def _gelu_data(ctx: Any, x: Tensor) -> Tensor:
    ctx.save_for_backward(x)
    return F.gelu(x)


def _gelu_as_relu(ctx: Any, g: Tensor) -> Tensor:  # the backward of another function
    (x,) = ctx.saved_tensors
    return g * (x > 0).to(g.dtype)


BUGS = {
    "SwishSTE": (_swish, _swish_half),
    "FusedGeluSTE": (_gelu_data, _gelu_as_relu),
    "GeluPassThrough": (_gelu_data, _identity),  # c = 1, but its forward is not constant
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_a_wrong_backward_named_like_an_estimator_is_still_an_error(name: str) -> None:
    torch.manual_seed(0)
    found = _error(_probe(STENet(_ste(name, *BUGS[name])), domain_batch(), ce))
    assert found.details["custom_functions"] == [name]


# -- a point where the loss has a kink: autograd's is a one-sided derivative ----------------


class _Kinked(nn.Module):
    """Half of ``w`` sits exactly at ReLU's kink (a weight clamped to 0, a projected
    perturbation): autograd's ``relu'(0) = 0`` is the left derivative there, and the central
    difference is the mean of the two sides. ``wrong`` adds a swish whose backward forgets a
    term: a wrong derivative beside the kink."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        w = torch.randn(16)
        w[::2] = 0.0
        self.w, self.lin, self.wrong = nn.Parameter(w), nn.Linear(4, 16), wrong

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x))
        if self.wrong:
            h = Swish.apply(h)
        return h * F.relu(self.w)


def _kink_loss(m: nn.Module, b: Any) -> Tensor:
    return m(b).sum()


def test_a_loss_at_a_kink_is_no_mismatch() -> None:
    torch.manual_seed(0)
    x = torch.rand(8, 4)
    report = _probe(_Kinked(), x, _kink_loss)
    _passes(report)
    statuses = {row.name: row.status for row in report.probes[0].layers}
    assert statuses["(root)"] == "inconclusive", statuses  # not a pass of w: no evidence
    assert "1 layer(s) inconclusive ((root))" in report.probes[0].note
    found = _error(_probe(_Kinked(wrong=True), x, _kink_loss))  # a wrong derivative still is
    assert [row["name"] for row in found.details["layers"]] == ["lin"]


def test_a_joint_direction_not_judged_is_no_pass_when_no_layer_was_compared() -> None:
    torch.manual_seed(0)
    x = torch.rand(8, 4)
    cfg = {**CFG, "checks": {**CFG["checks"], CHECK: {"budget_s": 1e-6}}}  # the joint only
    opt = torch.optim.Adam((model := _Kinked()).parameters(), lr=1e-3)
    record = gradwatch.probe(model, x, _kink_loss, opt, config=cfg).probes[0]
    assert not record.layers and record.details["joint"]["status"] == "inconclusive"
    assert "random direction (inconclusive: not judged)" in record.note, record.note
    assert record.verdict == "not_observed"  # no pass where nothing was judged
    assert record.details["reason"] == "nothing_judged"


class _NearKinks(nn.Module):
    """Every ReLU unit's input for the first sample 1e-6 from its kink, alternately above and
    below: the default step (1e-5 of the weights) crosses most of them, one a hundred times
    shorter none. ``wrong``: a swish whose backward drops a term, behind the ReLUs."""

    def __init__(self, x: Tensor, wrong: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.wrong = nn.Linear(16, 64), nn.Linear(64, 1), wrong
        with torch.no_grad():
            sign = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)
            self.a.bias -= self.a(x[:1])[0] - 1e-6 * sign

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.a(x))
        return self.b(Swish.apply(h) if self.wrong else h)


def _square(m: nn.Module, b: Any) -> Tensor:
    return m(b).pow(2).sum()


def test_kinks_crossed_by_the_step_are_compared_again_at_a_shorter_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradwatch.probes import gradient

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    report = _probe(_NearKinks(x), x, _square)
    _passes(report)
    rows = {row.name: row for row in report.probes[0].layers}
    assert rows["a"].status == "agree" and rows["a"].error < 1e-6, rows["a"]
    monkeypatch.setattr(gradient, "FINER", 1.0)  # the default step alone: no evidence
    before = _probe(_NearKinks(x), x, _square).probes[0].layers
    assert {row.name: row.status for row in before}["a"] == "inconclusive"
    monkeypatch.undo()
    found = _error(_probe(_NearKinks(x, wrong=True), x, _square))  # a wrong one still is
    assert [row["name"] for row in found.details["layers"]] == ["a"]  # upstream of the swish
