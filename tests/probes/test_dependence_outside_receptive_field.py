"""``dependence_outside_receptive_field``: three reshapes that scramble axes (from
practitioners' reports), and the correct designs that resemble them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _probe_models import findings, only, verdicts
from torch import Tensor, nn

import gradwatch
from gradwatch.probes._reach_ops import regroups

CHECK = "dependence_outside_receptive_field"
CFG = only(CHECK)


def _probe(model: nn.Module, batch: Any, loss_fn: Any) -> gradwatch.Report:
    return gradwatch.probe(model, batch, loss_fn, config=CFG)


class ConvOverFeatures(nn.Module):
    """A Conv1d over ``(B, L, C)`` features: ``x.view(B, C, L)`` instead of ``transpose``."""

    def __init__(self, scramble: bool = True) -> None:
        super().__init__()
        self.conv, self.head, self.scramble = (
            nn.Conv1d(6, 16, 3, padding=1),
            nn.Linear(16, 5),
            scramble,
        )

    def forward(self, x: Tensor) -> Tensor:
        b, length, c = x.shape
        h = torch.relu(self.conv(x.view(b, c, length) if self.scramble else x.transpose(1, 2)))
        return self.head(h.transpose(1, 2))


class PixelHead(nn.Module):
    """A segmentation net whose per-pixel head gets ``feat.view(B, H, W, C)`` of a
    ``(B, C, H, W)`` map instead of ``permute(0, 2, 3, 1)``."""

    def __init__(self, scramble: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
        )
        self.head, self.scramble = nn.Linear(8, 4), scramble

    def forward(self, x: Tensor) -> Tensor:
        f = self.body(x)
        b, c, h, w = f.shape
        f = f.view(b, h, w, c) if self.scramble else f.permute(0, 2, 3, 1)
        return self.head(f).permute(0, 3, 1, 2)


class TcnViewBack(nn.Module):
    """A causal TCN (left padding, chomp) whose output is viewed back to ``(B, L, C)``
    instead of transposed."""

    def __init__(self, scramble: bool = True) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv1d(4 if i == 0 else 8, 8, 2, dilation=2**i) for i in range(2)
        )
        self.head, self.scramble = nn.Linear(8, 3), scramble

    def forward(self, x: Tensor) -> Tensor:  # x: (B, L, 4)
        h = x.transpose(1, 2)
        for i, conv in enumerate(self.convs):
            h = torch.relu(conv(F.pad(h, (2**i, 0))))
        b, c, length = h.shape
        out = h.reshape(b, length, c) if self.scramble else h.transpose(1, 2)
        return self.head(out)


def _seq(c: int) -> Any:
    def make() -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(0)
        return torch.randn(4, 24, c, generator=gen), torch.randn(4, 24, 3, generator=gen)

    return make


def _image() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 40, 40, generator=gen), torch.randint(0, 4, (2, 40, 40), generator=gen)


def _mse(m: nn.Module, b: Any) -> Tensor:
    out = m(b[0])
    return out.pow(2).mean()


def _seg(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize(
    "make, batch, loss_fn, op",
    [
        (ConvOverFeatures, _seq(6), _mse, "view"),
        (PixelHead, _image, _seg, "view"),
        (TcnViewBack, _seq(4), _mse, "reshape"),
    ],
)
def test_a_reshape_that_scrambles_positions_is_found(
    make: Any, batch: Any, loss_fn: Any, op: str
) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    (finding,) = findings(report, CHECK)
    assert finding.severity == "error" and report.failed
    assert finding.details["reshape"]["op"] == op
    assert "test_dependence_outside_receptive_field.py" in finding.details["reshape"]["line"]
    assert finding.details["reached_positions"]
    assert verdicts(report) == {CHECK: "finding"}


class Tagger(nn.Module):
    """A per-token MLP tagger over embeddings: a field of one position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mlp = (
            nn.Embedding(30, 8),
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5)),
        )

    def forward(self, ids: Tensor) -> Tensor:
        return self.mlp(self.embed(ids))


class UNetish(nn.Module):
    """Down by pooling, up by interpolation, a skip concatenated on the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, padding=1)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.dec = nn.Conv2d(16, 4, 1)

    def forward(self, x: Tensor) -> Tensor:
        e = torch.relu(self.enc(x))
        m = torch.relu(self.mid(F.max_pool2d(e, 2)))
        up = F.interpolate(m, scale_factor=2)
        return self.dec(torch.cat([e, up], dim=1))


class SubPixel(nn.Module):
    """ESPCN's super-resolution: convs then ``pixel_shuffle`` (channels to positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 3 * 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.pixel_shuffle(self.b(torch.tanh(self.a(x))), 2)


def _ids() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 30, (4, 20), generator=gen), torch.randint(0, 5, (4, 20), generator=gen)


def _tag(m: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(m(b[0]).transpose(1, 2), b[1])


@pytest.mark.parametrize(
    "make, batch, loss_fn",
    [
        (lambda: ConvOverFeatures(scramble=False), _seq(6), _mse),
        (lambda: PixelHead(scramble=False), _image, _seg),
        (lambda: TcnViewBack(scramble=False), _seq(4), _mse),
        (Tagger, _ids, _tag),
        (UNetish, _image, _seg),
        (SubPixel, _image, _mse),
    ],
)
def test_correct_designs_that_resemble_them_pass(make: Any, batch: Any, loss_fn: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    assert verdicts(report) == {CHECK: "passed"}, report.probes[0].details


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.enc, self.head = (
            nn.TransformerEncoder(layer, 1, enable_nested_tensor=False),
            nn.Linear(16, 5),
        )

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.enc(self.embed(ids)))


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv1d(6, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.conv(x.transpose(1, 2)).mean(-1))


@pytest.mark.parametrize(
    "make, batch, loss_fn, why",
    [
        (Encoder, _ids, _tag, "every position is in reach"),
        (Pooled, _seq(6), _mse, "position axes"),
    ],
)
def test_models_that_reach_every_position_are_said_not_judged(
    make: Any, batch: Any, loss_fn: Any, why: str
) -> None:
    torch.manual_seed(0)
    report = _probe(make(), batch(), loss_fn)
    assert verdicts(report) == {CHECK: "not_observed"} and not report.findings
    assert why in report.probes[0].note


def test_a_regroup_is_told_from_a_merge_or_a_split() -> None:
    assert regroups((4, 6, 24), (4, 24, 6))  # view(B, L, C) of (B, C, L)
    assert not regroups((4, 24, 6), (4, 144))  # flatten
    assert not regroups((4, 24, 16), (4, 24, 2, 8))  # heads split
    assert not regroups((4, 2, 24, 8), (8, 24, 8))  # merged into the batch


class Mixer(nn.Module):
    """MLP-Mixer's token mixing: a Linear over the positions (after a transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.channels = nn.Linear(24, 24), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.channels(x + self.tokens(x.transpose(1, 2)).transpose(1, 2))


class LoopRecurrence(nn.Module):
    """A recurrence written as a Python loop over positions (RWKV's or a hand-written RNN's)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h, outs = torch.zeros(x.shape[0], 8), []
        for t in range(x.shape[1]):
            h = torch.tanh(0.5 * h + self.inp(x[:, t]))
            outs.append(h)
        return self.head(torch.stack(outs, dim=1))


@pytest.mark.parametrize("make", [Mixer, LoopRecurrence])
def test_layers_that_reach_every_position_by_other_means_are_not_judged(make: Any) -> None:
    torch.manual_seed(0)
    report = _probe(make(), _seq(6)(), _mse)
    assert verdicts(report) == {CHECK: "not_observed"} and not report.findings
