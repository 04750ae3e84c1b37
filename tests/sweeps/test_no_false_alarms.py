"""Correct training code that must not raise anything at warning level or above."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as cp
from _loops import batches, fired, mlp, train
from torch import nn

import gradwatch


def _assert_clean(report: gradwatch.Report) -> None:
    assert fired(report) == set(), [f.line() for f in report.findings]
    assert not report.failed


def test_gan_where_d_steps_before_g_ever_had_a_backward() -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"G": G, "D": D})
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    with gradwatch.watch(gan, [opt_d, opt_g], config={"every_n_steps": 1}) as w:
        for _ in range(6):  # the DCGAN loop
            real, z = torch.randn(8, 8), torch.randn(8, 4)
            D.zero_grad()
            fake = G(z)
            loss_d = bce(D(real), torch.ones(8, 1)) + bce(D(fake.detach()), torch.zeros(8, 1))
            loss_d.backward()
            opt_d.step()
            G.zero_grad()
            bce(D(fake), torch.ones(8, 1)).backward()  # also writes into D's .grad
            opt_g.step()
    report = w.report()
    _assert_clean(report)
    assert report.steps == 12 and report.backward_passes == 12


def test_lbfgs_closure() -> None:
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(3):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    report = w.report()
    _assert_clean(report)
    assert report.steps == 3 and report.backward_passes >= 6


def test_gradient_accumulation_over_four_micro_batches() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(16)):
            (nn.functional.mse_loss(model(x), y) / 4).backward()
            if k % 4 == 3:
                opt.step()
                opt.zero_grad()
    report = w.report()
    _assert_clean(report)
    assert report.steps == 4 and report.backward_passes == 16


def test_frozen_backbone() -> None:
    model = nn.Sequential(mlp(8, 16, 8), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01))
    _assert_clean(report)
    (frozen,) = {f.check for f in report.findings}
    assert frozen == "frozen_in_optimizer"
    assert report.coverage.frozen == 4 and report.coverage.trainable == 2


def test_tied_embedding_and_lm_head() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(30, 16)
            self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, 30, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.embed(ids)))

    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(m: nn.Module, b: object) -> torch.Tensor:
        ids = torch.randint(0, 30, (4, 7))
        return nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())

    report = train(model, opt, steps=4, loss=loss)
    _assert_clean(report)


def test_batchnorm_buffers_are_not_parameters() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1)
    )

    def loss(m: nn.Module, b: object) -> torch.Tensor:
        return m(torch.randn(4, 3, 6, 6)).pow(2).mean()

    model(torch.randn(2, 3, 6, 6))  # materialise the lazy head before building the optimizer
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01), loss=loss)
    _assert_clean(report)
    names = {p for layer in report.layers for p in layer.params}
    assert "1.running_mean" not in names and "1.weight" in names


def test_retain_graph_double_backward() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(4):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward(retain_graph=True)
            (0.5 * loss).backward()
            opt.step()
    _assert_clean(w.report())


def test_backbone_unfrozen_and_added_mid_training() -> None:
    model = nn.Sequential(mlp(8, 16, 8), nn.Linear(8, 1))
    backbone, head = model[0], model[1]
    backbone.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(8)):
            if k == 4:
                backbone.requires_grad_(True)
                opt.add_param_group({"params": backbone.parameters(), "lr": 1e-3})
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    report = w.report()
    _assert_clean(report)
    layer = next(lyr for lyr in report.layers if lyr.name == "0.0")
    # Its hooks go on at the step where the optimizer changed: judged from the next step on.
    assert layer.steps_with_grad == 3 and layer.steps_without_grad == 0 and layer.in_optimizer


def test_gradient_penalty_with_autograd_grad() -> None:
    """``torch.autograd.grad`` runs tensor hooks but accumulates nothing: not a gradient."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(4):
            opt.zero_grad()
            x.requires_grad_(True)
            out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = nn.functional.mse_loss(out, y) + 0.1 * gx.pow(2).mean()
            loss.backward()
            opt.step()
    _assert_clean(w.report())


def test_non_reentrant_checkpoint() -> None:
    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = mlp(8, 16, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(cp.checkpoint(self.block, x, use_reentrant=False))

    model = Ckpt()
    _assert_clean(train(model, torch.optim.SGD(model.parameters(), lr=0.01)))
