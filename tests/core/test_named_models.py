"""``watch({"G": netG, "D": netD}, {"G": opt_g, "D": opt_d})``: a GAN watched as named models.

A tiny DCGAN (transposed convolutions and batch norm in G, strided convolutions in D) trained
the usual way. Correct: silent, and every name (findings, layers, the JSON/HTML report, the
CSV and TensorBoard sinks) carries its model's prefix, ``G:0.weight``. Bug forms, each named
with ``G:``: G's optimizer never stepped, G's step through ``D(G(z).detach())``, and G left out
of the optimizers. The argument forms: a dict of models with a list of optimizers, one
optimizer over both models, named optimizers of one plain model, and the one-line errors of
mismatched, swapped or malformed names.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _loops import fired
from torch import nn

import gradwatch
from gradwatch.checks.coverage import NotInOptimizer
from gradwatch.checks.loss_disconnected import LossDisconnected
from gradwatch.checks.stale import StaleParam
from gradwatch.errors import ConfigError, GradWatchError
from gradwatch.sinks import CSVSink

CFG: dict[str, Any] = {"every_n_steps": 1, "on_internal_error": "raise", "console": False}
NZ, BATCH, STEPS = 8, 8, 6


def generator() -> nn.Sequential:
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, 16, 4, 1, 0, bias=False),  # 1x1 -> 4x4
        nn.BatchNorm2d(16),
        nn.ReLU(True),
        nn.ConvTranspose2d(16, 1, 4, 2, 1, bias=False),  # 4x4 -> 8x8
        nn.Tanh(),
    )


def discriminator() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 4, 2, 1, bias=False),  # 8x8 -> 4x4
        nn.LeakyReLU(0.2, True),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False),  # 4x4 -> 1x1
        nn.Flatten(),
    )


def adam(model: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.5, 0.999))


def gan_loop(
    netG: nn.Module,
    netD: nn.Module,
    opt_g: torch.optim.Optimizer,
    opt_d: torch.optim.Optimizer,
    *,
    detach_g: bool = False,
    step_g: bool = True,
) -> None:
    """The DCGAN example's loop (pytorch/examples), on random 8x8 'images'."""
    bce = nn.BCEWithLogitsLoss()
    real_label, fake_label = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        real = torch.randn(BATCH, 1, 8, 8, generator=gen)
        noise = torch.randn(BATCH, NZ, 1, 1, generator=gen)
        netD.zero_grad()
        fake = netG(noise)
        err_d = bce(netD(real), real_label) + bce(netD(fake.detach()), fake_label)
        err_d.backward()
        opt_d.step()
        netG.zero_grad()
        out = netD(fake.detach() if detach_g else fake)  # detach here: G's loss is cut off
        bce(out, real_label).backward()
        if step_g:
            opt_g.step()


def watched_gan(
    optimizers: Optional[Any] = None, sinks: tuple[Any, ...] = (), **loop: Any
) -> gradwatch.Report:
    torch.manual_seed(0)
    netG, netD = generator(), discriminator()
    opt_g, opt_d = adam(netG), adam(netD)
    opts = {"G": opt_g, "D": opt_d} if optimizers is None else optimizers(opt_g, opt_d)
    with gradwatch.watch({"G": netG, "D": netD}, opts, config=CFG, sinks=sinks) as w:
        gan_loop(netG, netD, opt_g, opt_d, **loop)
    return w.report()


def test_a_correct_gan_is_silent_and_every_output_names_g_and_d(tmp_path: Path) -> None:
    tb = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv_path, logdir = tmp_path / "metrics.csv", tmp_path / "tb"
    from gradwatch.sinks import TensorBoardSink

    report = watched_gan(sinks=(CSVSink(csv_path), TensorBoardSink(tb.SummaryWriter(logdir))))
    assert not fired(report, "warning"), report.findings
    assert [layer.name for layer in report.layers] == ["G:0", "G:1", "G:3", "D:0", "D:2"]
    assert report.layers[1].params == ["G:1.weight", "G:1.bias"]
    assert report.coverage.optimizers == 2 and report.coverage.not_in_optimizer == 0

    back = gradwatch.Report.model_validate_json(report.model_dump_json())
    assert back.layers[0].name == "G:0"
    assert '"G:0.weight"' in json.dumps(report.model_dump(mode="json"))
    html = report.to_html(tmp_path / "report.html").read_text()
    assert "G:3" in html and "D:2" in html

    with csv_path.open() as fh:
        metrics = {row["metric"] for row in csv.DictReader(fh)}
    assert {"grad_norm/G:0", "grad_norm/D:2"} <= metrics
    assert {"grad_norm_total/optimizer_G", "grad_norm_total/optimizer_D"} <= metrics
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert {"gradwatch/grad_norm/G:3", "gradwatch/grad_norm/D:0"} <= set(acc.Tags()["scalars"])


def test_g_never_stepped_is_named_with_g() -> None:
    report = watched_gan(step_g=False)
    (f,) = [f for f in report.by_check(StaleParam.id) if f.details.get("cause") == "never_stepped"]
    assert f.severity == "error" and report.failed
    assert f.message.startswith("optimizer['G'] never stepped"), f.message
    assert "optimizer['G'].step()" in f.hint
    assert f.details["optimizer"] == 0 and f.details["optimizer_name"] == "optimizer['G']"
    assert sorted(f.params) == ["G:0.weight", "G:1.bias", "G:1.weight", "G:3.weight"]


def test_g_step_through_a_detached_fake_is_named_with_g() -> None:
    report = watched_gan(detach_g=True)
    (f,) = report.by_check(LossDisconnected.id)
    assert f.severity == "error" and f.details["cause"] == "disconnected"
    assert f.message.startswith("optimizer['G'].step() found no gradient"), f.message
    assert sorted(f.params) == ["G:0.weight", "G:1.bias", "G:1.weight", "G:3.weight"]
    assert fired(report, "error") == {LossDisconnected.id}, report.findings


def test_g_left_out_of_the_optimizers_is_named_with_g() -> None:
    # opt_g still steps, unwatched: gradwatch sees G's parameters in no watched optimizer.
    report = watched_gan(optimizers=lambda og, od: {"D": od})
    found = {p for f in report.by_check(NotInOptimizer.id) for p in f.params}
    assert found == {"G:0.weight", "G:1.weight", "G:1.bias", "G:3.weight"}
    assert report.coverage.not_in_optimizer == 4


def test_a_list_of_optimizers_and_one_optimizer_over_both_models() -> None:
    report = watched_gan(optimizers=lambda og, od: [og, od], step_g=False)
    (f,) = [f for f in report.by_check(StaleParam.id) if f.details.get("cause") == "never_stepped"]
    assert f.message.startswith("optimizer[0] never stepped") and f.params[0].startswith("G:")

    enc, dec = nn.Linear(8, 4), nn.Linear(4, 8)
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
    with gradwatch.watch({"enc": enc, "dec": dec}, {"enc": opt}, config=CFG) as w:
        for _ in range(4):
            opt.zero_grad()
            x = torch.randn(16, 8)
            nn.functional.mse_loss(dec(enc(x).detach()), x).backward()  # enc cut off
            opt.step()
    ghosts = {p for f in w.report().by_check("ghost_param") for p in f.params}
    assert ghosts == {"enc:weight", "enc:bias"}, w.report().findings
    assert [layer.name for layer in w.report().layers] == ["enc", "dec"]


def test_named_optimizers_of_one_plain_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    body, head = (
        torch.optim.SGD(model[0].parameters(), 0.1),
        torch.optim.SGD(model[2].parameters(), 0.1),
    )
    with gradwatch.watch(model, {"body": body, "head": head}, config=CFG) as w:
        for _ in range(4):
            body.zero_grad()
            head.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            body.step()
    (f,) = [
        f for f in w.report().by_check(StaleParam.id) if f.details.get("cause") == "never_stepped"
    ]
    assert f.message.startswith("optimizer['head'] never stepped")
    assert f.params == ["2.weight", "2.bias"]  # a plain model: no prefix


@pytest.mark.parametrize(
    ("models", "optimizers", "said"),
    [
        ("both", {"G": "og", "X": "od"}, "optimizer 'X' names no watched model"),
        ("both", {"G": "od", "D": "og"}, "optimizer 'G' holds no parameter of model 'G'"),
        ({"G:x": "G"}, None, "model name 'G:x' may not hold ':'"),
        ({"": "G"}, None, "model names must be non-empty strings"),
        ({"G": "G", "H": "G"}, None, "models 'G' and 'H' are the same module"),
        ({"G": 3}, None, "model 'G' is a int, not a torch.nn.Module"),
        ({}, None, "empty dict of models"),
        ("both", {"G": "og", "D": 7}, "optimizer 'D' is a int"),
    ],
)
def test_bad_names_are_one_line_config_errors(models: Any, optimizers: Any, said: str) -> None:
    netG, netD = generator(), discriminator()
    objs: dict[str, Any] = {"G": netG, "D": netD, "og": adam(netG), "od": adam(netD)}
    if models == "both":
        models = {"G": netG, "D": netD}
    else:
        models = {k: objs.get(v, v) if isinstance(v, str) else v for k, v in models.items()}
    if optimizers is not None:
        optimizers = {k: objs.get(v, v) if isinstance(v, str) else v for k, v in optimizers.items()}
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(models, optimizers, config=CFG)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_one_watcher_per_named_model_and_every_hook_removed_on_exit() -> None:
    from test_cleanup import hook_state

    netG, netD = generator(), discriminator()
    opt_g, opt_d = adam(netG), adam(netD)
    before = (hook_state(netG, opt_g), hook_state(netD, opt_d))
    with gradwatch.watch({"G": netG, "D": netD}, {"G": opt_g, "D": opt_d}, config=CFG):
        with pytest.raises(GradWatchError, match=r"Sequential is .* watcher \(as model 'G'\)"):
            gradwatch.watch(netG, opt_g).attach()
        with pytest.raises(GradWatchError, match=r"model 'D' \(Sequential\) is already watched"):
            gradwatch.watch({"X": generator(), "D": netD}).attach()
        gan_loop(netG, netD, opt_g, opt_d)
    assert (hook_state(netG, opt_g), hook_state(netD, opt_d)) == before
    assert "zero_grad" not in vars(opt_g) and "zero_grad" not in vars(opt_d)
    with gradwatch.watch(netG, opt_g, config=CFG):  # free again
        pass


class BroadcastLinear(nn.Linear):
    """A linear written as multiply-and-sum: no op autocast casts (it escapes bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(-1) * self.weight.t()).sum(-2) + self.bias


def test_checks_that_enter_at_the_model_see_each_named_model() -> None:
    # autocast_bypassed's probe enters at the model: here at G and D, never the container.
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), BroadcastLinear(16, 8))
    netD = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g, opt_d = adam(netG), adam(netD)
    with gradwatch.watch({"G": netG, "D": netD}, {"G": opt_g, "D": opt_d}, config=CFG) as w:
        for _ in range(4):
            opt_d.zero_grad()
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                score = netD(netG(torch.randn(16, 4)))
            score.float().mean().backward()
            opt_d.step()
            opt_g.step()
    (f,) = w.report().by_check("autocast_bypassed")
    assert f.module == "G:2" and sorted(f.params) == ["G:2.bias", "G:2.weight"]
