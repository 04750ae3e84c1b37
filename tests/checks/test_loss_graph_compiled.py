"""The loss-graph rules under torch.compile, AMP with a GradScaler, and a Lightning-style
``training_step`` loss: what they still see, and what they say they cannot.

Under torch.compile the model's inside is one opaque node of the graph and no module hook is
added: a softmax inside the compiled model is not seen, and the run says so (an ``info``
``not_observed``, ``details.reason = "compiled_forward"``, ``details.part = "loss_graph"``,
naming the rules), never a
silent pass; the loss's own ops outside the compiled model (a broadcast in ``mse_loss``) are
still judged.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _check_loops import CFG
from torch import nn

import gradwatch


class Net(nn.Module):
    def __init__(self, out: int, softmax: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, out)
        self.softmax = softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc2(torch.relu(self.fc1(x)))
        return z.softmax(-1) if self.softmax else z


def _data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _parts(report: Any) -> dict[str, Any]:
    """The parts compile hid, each with its checks: one finding lists them all."""
    (note,) = report.by_check("not_observed")
    assert note.severity == "info"
    return dict(note.details["by_part"])


@pytest.mark.slow  # torch.compile: a few seconds on CPU with the aot_eager backend
def test_compiled_model_says_what_it_cannot_see_and_judges_the_loss_outside() -> None:
    torch.manual_seed(0)
    model = Net(1, softmax=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled: Any = torch.compile(model, backend="aot_eager")
    with gradwatch.watch(compiled, opt, config=CFG) as w, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using a target size")
        for k in range(3):
            x, y = _data(k)
            opt.zero_grad()
            F.mse_loss(compiled(x), y.float()).backward()  # (16, 1) against (16,)
            opt.step()
    report = w.report()
    checks = _parts(report)["loss_graph"]
    assert not report.failed or report.by_check("loss_broadcast")
    assert "loss_input_already_normalised" in checks
    (f,) = report.by_check("loss_broadcast")
    assert f.details["broadcast_shape"] == [16, 16]


def test_amp_with_a_grad_scaler_still_sees_the_softmax() -> None:
    model = Net(4, softmax=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with gradwatch.watch(model, opt, config=CFG, scaler=scaler) as w:
        for k in range(3):
            x, y = _data(k)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    (f,) = w.report().by_check("loss_input_already_normalised")
    assert f.module == "Net"


def test_lightning_style_training_step_loss_is_read() -> None:
    """Lightning and the HF Trainer call ``loss.backward()`` on what ``training_step`` /
    ``compute_loss`` returned: the same wrapped ``Tensor.backward``."""
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(4, softmax=True)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from gradwatch.lightning import GradWatchCallback

    xs, ys = zip(*(_data(k) for k in range(4)))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16
    )
    cb = GradWatchCallback(config={**CFG, "warn": False})
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), train_dataloaders=data)
    assert cb.report is not None
    (f,) = cb.report.by_check("loss_input_already_normalised")
    assert f.module == "net"
