"""One root cause, one finding: a param group at lr 0 is one ``stale_param`` naming the
group; a submodule tree left out of the optimizer is one ``not_in_optimizer`` naming the
subtree; and when most of the model does not train, the finding is an error.

The share rule: warning/error findings of ``ghost_param``, ``stale_param`` and
``not_in_optimizer`` that together hold more than half of the model's trainable elements are
each an error, whatever the check's default (``details.model_share``).
"""

from __future__ import annotations

import math

import torch
from _loops import train
from torch import nn

import gradwatch


class Tiny(nn.Module):
    """A small pre-norm MLP-mixer-like stack: Linear layers with biases and LayerNorms."""

    def __init__(self, blocks: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def _nodecay_groups(model: nn.Module, nodecay_lr: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": nodecay_lr},
    ]


def _names(model: nn.Module, keep) -> set[str]:  # type: ignore[no-untyped-def]
    return {n for n, p in model.named_parameters() if keep(n, p)}


# -- stale_param: one finding per param group -------------------------------------------------


def test_adamw_nodecay_group_at_lr_zero_is_one_finding_naming_the_group() -> None:
    model = Tiny()
    opt = torch.optim.AdamW(_nodecay_groups(model, 0.0), lr=1e-3)
    report = train(model, opt, steps=5)
    (stale,) = report.by_check("stale_param")
    assert stale.details["cause"] == "lr_zero" and stale.details["group"] == 1
    assert "optimizer[0].group[1]" in stale.message
    # every parameter of the group that had a gradient: the biases of layers whose weights
    # train as well as the norms
    assert set(stale.params) == _names(model, lambda n, p: p.dim() < 2)
    assert stale.severity == "warning" and "model_share" not in stale.details  # a minority


def test_a_backbone_group_at_lr_zero_in_a_fine_tune_is_an_error_by_its_share() -> None:
    """Differential learning rates with the backbone's set to 0 by mistake: most of the
    model does not train, so the warning-level check reports an error."""
    model = Tiny(blocks=4)
    backbone = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.SGD(
        [{"params": backbone, "lr": 0.0}, {"params": model.head.parameters(), "lr": 0.05}]
    )
    report = train(model, opt, steps=5)
    (stale,) = report.by_check("stale_param")
    assert stale.details["group"] == 0 and len(stale.params) == len(backbone)
    assert stale.severity == "error" and stale.details["model_share"] > 0.9
    assert report.failed  # fail_on=error


def test_a_scheduler_holding_one_group_at_zero_is_one_finding() -> None:
    model = Tiny()
    opt = torch.optim.SGD(_nodecay_groups(model, 0.05), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.0])
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            sched.step()
    (stale,) = w.report().by_check("stale_param")
    assert stale.details["group"] == 1 and stale.details["cause"] == "lr_zero"


def test_two_groups_at_lr_zero_are_two_findings() -> None:
    """The embedding's group and the norms' group, each at lr 0 for its own reason."""
    model = Tiny()
    embed = list(model.embed.parameters())
    norms = [p for n, p in model.named_parameters() if "norm" in n or ".0." in n]
    rest = [p for p in model.parameters() if all(p is not q for q in embed + norms)]
    opt = torch.optim.SGD(
        [{"params": embed, "lr": 0.0}, {"params": norms, "lr": 0.0}, {"params": rest}], lr=0.05
    )
    report = train(model, opt, steps=5)
    groups = sorted(f.details["group"] for f in report.by_check("stale_param"))
    assert groups == [0, 1]


def test_lr_zero_everywhere_fails_the_report() -> None:
    model = Tiny()
    opt = torch.optim.AdamW(_nodecay_groups(model, 0.0), lr=0.0)
    report = train(model, opt, steps=5)
    found = report.by_check("stale_param")
    assert len(found) == 2 and all(f.severity == "error" for f in found)
    assert all(math.isclose(f.details["model_share"], 1.0) for f in found)
    assert report.failed and "Most of the model (100% of its" in found[0].message


# -- not_in_optimizer: one finding per subtree ------------------------------------------------


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.decoder = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_an_optimizer_on_the_decoder_only_is_one_finding_naming_the_encoder() -> None:
    model = EncoderDecoder()
    report = train(model, torch.optim.Adam(model.decoder.parameters(), lr=1e-3))
    (orphan,) = report.by_check("not_in_optimizer")
    assert orphan.module == "encoder" and orphan.details["layers"] == ["encoder.0", "encoder.2"]
    assert set(orphan.params) == _names(model, lambda n, p: n.startswith("encoder."))
    assert "of 'encoder' are in no optimizer" in orphan.message


def test_a_head_added_after_the_optimizer_is_one_finding() -> None:
    model = EncoderDecoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.aux = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    original = model.forward
    model.forward = lambda x: original(x) + model.aux(model.encoder(x))  # type: ignore[method-assign]
    report = train(model, opt)
    (orphan,) = report.by_check("not_in_optimizer")
    assert orphan.module == "aux" and len(orphan.params) == 4
    assert orphan.severity == "warning"  # a small part of the model


def test_param_groups_by_name_that_miss_an_adapter() -> None:
    model = EncoderDecoder()
    model.encoder.add_module("adapter", nn.Sequential(nn.Linear(16, 4), nn.Linear(4, 16)))
    named = [p for n, p in model.named_parameters() if "adapter" not in n]
    model.forward = lambda x: model.decoder(model.encoder(x))  # type: ignore[method-assign]
    report = train(model, torch.optim.SGD(named, lr=0.01))
    (orphan,) = report.by_check("not_in_optimizer")
    assert orphan.module == "encoder.adapter"


def test_two_separate_subtrees_out_of_the_optimizer_are_two_findings() -> None:
    model = EncoderDecoder()
    held = [model.encoder[0], model.decoder[0]]  # encoder.2 and decoder.2 left out
    report = train(model, torch.optim.SGD([p for m in held for p in m.parameters()], lr=0.01))
    assert sorted(f.module for f in report.by_check("not_in_optimizer")) == [
        "decoder.2",
        "encoder.2",
    ]


def test_most_of_the_model_in_no_optimizer_fails() -> None:
    model = nn.Sequential(
        nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    report = train(model, torch.optim.SGD(model[4].parameters(), lr=0.01))
    found = report.by_check("not_in_optimizer")
    assert found and all(f.severity == "error" for f in found)
    assert report.failed


def test_an_ema_copy_is_info_and_apart_from_a_forgotten_layer() -> None:
    class WithEma(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = EncoderDecoder()
            self.ema = EncoderDecoder()  # updated by hand, requires_grad left on
            self.extra = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.extra(self.net(x))

    model = WithEma()
    report = train(model, torch.optim.SGD(model.net.parameters(), lr=0.01))
    by_module = {f.module: f.severity for f in report.by_check("not_in_optimizer")}
    assert by_module == {"ema": "info", "extra": "warning"}


def test_disconnected_loss_summary_says_no_backward_pass_reached_the_model() -> None:
    model = EncoderDecoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        for _ in range(5):
            opt.zero_grad()
            loss = torch.tensor(model(torch.randn(4, 8)).pow(2).mean().item(), requires_grad=True)
            loss.backward()
            opt.step()
    report = w.report()
    assert report.backward_passes == 0
    assert "none reached the model" in report.summary()
    assert "0 backward passes" not in report.summary()
