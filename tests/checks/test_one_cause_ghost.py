"""One root cause, one finding: ``ghost_param`` groups the layers of one cause.

Every layer cut off by one ``.detach()`` is one finding with ``details.cut`` naming the
module whose output was detached (from the forward's data flow); a subtree never called or
run under ``no_grad`` is one finding named by the subtree. Look-alikes stay apart: two
independent branches are two findings, two causes are two findings.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from _loops import ghosts, train
from torch import nn
from torch.nn import functional as F

import gradwatch


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())


class DetachedTrunk(nn.Module):
    """``head(ln(blocks(emb(x)).detach()))``: the /tmp field case of one detach."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[_block() for _ in range(4)])
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.emb(x)).detach()))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's layout (embeddings, a ModuleList of blocks, ln_f, tied head); the bug: the
    residual stream is detached before the final norm."""

    def __init__(self, vocab: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, 16)
        self.wpe = nn.Embedding(8, 16)
        self.h = nn.ModuleList(Block() for _ in range(blocks))
        self.ln_f = nn.LayerNorm(16)
        self.lm_head = nn.Linear(16, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x.detach()))


class FrozenFeatures(nn.Module):
    """A CNN whose features are detached before the classifier (a 'linear probe' by mistake:
    the backbone is in the optimizer and meant to train)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.backbone(x).detach()
        return self.classifier(feats.flatten(1))


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(batch[0].abs().sum().item() * 1000) % 1000)
    idx = torch.randint(32, (4, 8), generator=g)
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, 32), idx.reshape(-1))


def _image_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x = batch[0][:, :3].reshape(-1, 3, 1, 1).expand(-1, 3, 6, 6).contiguous()
    return F.mse_loss(model(x), batch[1].repeat(x.shape[0] // batch[1].shape[0], 1))


_SOURCE = Path(__file__).read_text(encoding="utf-8").splitlines()


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_one_detach_before_the_head_is_one_ghost_named_by_the_cut() -> None:
    model = DetachedTrunk()
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps=5)
    (finding,) = report.by_check("ghost_param")
    cut_off = {n for n in _trainable(model) if n.startswith(("emb.", "blocks."))}
    assert set(finding.params) == cut_off  # every parameter is still listed
    assert finding.details["cause"] == "disconnected"
    assert finding.details["cut"] == "blocks" and finding.module == "blocks"
    assert finding.details["cut_layer"] == "blocks.3.1"  # the last layer that ran
    assert len(finding.details["layers"]) == 9 and finding.count == 5
    assert "output of 'blocks'" in finding.message and finding.severity == "error"


def test_one_detach_before_the_final_norm_of_a_gpt() -> None:
    model = TinyGPT()
    report = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss=_lm_loss)
    (finding,) = report.by_check("ghost_param")
    expected = {n for n in _trainable(model) if n.startswith(("wpe.", "h."))}
    assert set(finding.params) == expected
    assert finding.details["cut"] == "h"  # the block list whose output was detached
    assert finding.details["cut_layer"].startswith("h.3.")
    assert "wte.weight" not in finding.params  # tied with lm_head: it trains


def test_detached_cnn_features_are_one_ghost() -> None:
    model = FrozenFeatures()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), loss=_image_loss)
    (finding,) = report.by_check("ghost_param")
    assert finding.details["cut"] == "backbone"
    assert set(finding.params) == {n for n in _trainable(model) if n.startswith("backbone.")}
    # the line that calls the cut module: where the .detach() is
    line = next(k for k, text in enumerate(_SOURCE, 1) if "self.backbone(x).detach()" in text)
    assert finding.details["called_at"].endswith(f"test_one_cause_ghost.py:{line}")


class TwoTowers(nn.Module):
    """Two encoders, each detached on its own: two cuts, two findings."""

    def __init__(self) -> None:
        super().__init__()
        self.tower_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.tower_b = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        za = self.tower_a(x).detach()
        zb = self.tower_b(x.flip(1)).detach()
        return self.head(torch.cat([za, zb], dim=1))


class UnusedAuxHeads(nn.Module):
    """Two auxiliary heads computed from the live trunk and ignored: independent branches."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.aux1 = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.aux2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        self.aux1(h)
        self.aux2(h)
        return self.head(h)


def test_two_independently_detached_towers_are_two_findings() -> None:
    model = TwoTowers()
    report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    found = {f.details.get("cut"): set(f.params) for f in report.by_check("ghost_param")}
    assert found == {
        "tower_a": {n for n in _trainable(model) if n.startswith("tower_a.")},
        "tower_b": {n for n in _trainable(model) if n.startswith("tower_b.")},
    }


def test_two_unused_heads_on_the_same_trunk_are_two_findings() -> None:
    model = UnusedAuxHeads()
    report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    found = sorted(f.module for f in report.by_check("ghost_param"))
    assert found == ["aux1", "aux2"]
    assert ghosts(report) == {n for n in _trainable(model) if n.startswith("aux")}


class NeverCalledAndDetached(nn.Module):
    """A never-called auxiliary decoder and a detached encoder: two causes, two findings."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.aux_decoder = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).detach())


def test_a_never_called_subtree_and_a_cut_are_two_findings() -> None:
    model = NeverCalledAndDetached()
    report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    by_cause = {f.details["cause"]: f for f in report.by_check("ghost_param")}
    assert set(by_cause) == {"not_called", "disconnected"}
    assert by_cause["not_called"].module == "aux_decoder"
    assert by_cause["disconnected"].details["cut"] == "encoder"
    assert len(by_cause["not_called"].params) == 4 and len(by_cause["disconnected"].params) == 4


def test_a_subtree_under_no_grad_is_one_finding() -> None:
    class NoGradEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                h = self.encoder(x)
            return self.head(h)

    model = NoGradEncoder()
    report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    (finding,) = report.by_check("ghost_param")
    assert finding.module == "encoder" and finding.details["cause"] == "no_grad"
    assert finding.details["layers"] == ["encoder.0", "encoder.2"]


def test_a_single_ghost_layer_keeps_its_own_name() -> None:
    """A layer on its own is named by itself, as before (no group, no cut)."""

    class Pooler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.pooler = nn.Linear(16, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            self.pooler(h)  # computed, then ignored
            return self.head(h)

    model = Pooler()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01))
    (finding,) = report.by_check("ghost_param")
    assert finding.module == "pooler" and "cut" not in finding.details
    assert finding.message.startswith("2 parameters of 'pooler' got no gradient")


def test_a_layer_replaced_after_the_optimizer_was_built_is_named() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.fc = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.body(x))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.fc = nn.Linear(16, 1)  # the bug: replaced after the optimizer was built
    report = train(model, opt)
    (ghost,) = report.by_check("ghost_param")
    assert ghost.details["cause"] == "not_in_model" and ghost.details["replaced"] == ["fc"]
    assert "old parameters of 'fc'" in ghost.message and "add_param_group" in ghost.hint
    (orphan,) = report.by_check("not_in_optimizer")
    assert orphan.module == "fc" and orphan.params == ["fc.weight", "fc.bias"]
    assert all(f.check != "param_outside_model" or "replaced" in f.hint for f in report.findings)


def test_one_warning_per_finding_at_the_users_line() -> None:
    model = DetachedTrunk()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    with gradwatch.watch(model, opt) as w:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()  # the line the warning names
    ours = [c for c in caught if issubclass(c.category, gradwatch.GradWatchWarning)]
    said = [f for f in w.report().findings if f.severity != "info"]  # info warns nobody
    assert len(ours) == len(said) == 1
    assert ours[0].filename == __file__
    assert "[blocks (18 parameters)]" in str(ours[0].message)
