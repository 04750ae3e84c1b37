"""Metric sinks on real training loops: TensorBoard event files and long-format CSV."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.errors import ConfigError
from gradwatch.sinks import CSVSink, Sink, TensorBoardSink

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)
from torch.utils.tensorboard import SummaryWriter


class GhostNet(nn.Module):
    """``ghost`` is built but never called: it never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.ghost = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc1(x)))


class LateBranch(nn.Module):
    """``late`` joins the forward pass from step ``start`` on (a curriculum, a warm-up head)."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.late = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.start = start
        self.t = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if self.t >= self.start:
            h = h + self.late(h)
        self.t += 1
        return self.head(h)


def _layer_norm(module: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.norm()) ** 2 for p in module.parameters()))


def _run(model: nn.Module, sinks: list, steps: int, every: int = 1) -> tuple:
    """Train; return the watcher and the layer norms computed independently per step."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: list[dict[str, float]] = []
    with gradwatch.watch(model, opt, sinks=sinks, config={"every_n_steps": every}) as w:
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
            expected.append(
                {
                    name: _layer_norm(m)
                    for name, m in model.named_children()
                    if all(p.grad is not None for p in m.parameters())
                }
            )
            opt.step()
    return w, expected


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_true_layer_norms(tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    w, expected = _run(GhostNet(), [TensorBoardSink(logdir)], steps=6)
    assert list(logdir.glob("events.out.tfevents.*")), "no event file written"
    scalars = _scalars(logdir)
    assert {
        "gradwatch/grad_norm/fc1",
        "gradwatch/grad_norm/head",
        "gradwatch/grad_norm_total",
        "gradwatch/findings",
    } <= set(scalars)
    assert "gradwatch/grad_norm/ghost" not in scalars  # it never had a gradient to measure
    for layer in ("fc1", "head"):
        events = scalars[f"gradwatch/grad_norm/{layer}"]
        assert [s for s, _ in events] == list(range(6))
        for (_, got), want in zip(events, expected):
            assert got == pytest.approx(want[layer], rel=1e-5)  # event files store float32
    for step, total in scalars["gradwatch/grad_norm_total"]:
        want = math.sqrt(expected[step]["fc1"] ** 2 + expected[step]["head"] ** 2)
        assert total == pytest.approx(want, rel=1e-5)
    assert scalars["gradwatch/findings"][-1][1] == len(w.report().findings) >= 1
    assert scalars["gradwatch/grad_norm/head"][-1][1] == pytest.approx(
        w.metrics["grad_norm/head"], rel=1e-6
    )


def test_tensorboard_respects_every_n_steps(tmp_path: Path) -> None:
    _run(GhostNet(), [TensorBoardSink(tmp_path)], steps=7, every=3)
    steps = [s for s, _ in _scalars(tmp_path)["gradwatch/grad_norm/fc1"]]
    assert steps == [0, 3, 6]


def test_tensorboard_user_writer_stays_open_and_histograms(tmp_path: Path) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer, histograms=True)
    _run(GhostNet(), [sink], steps=3)
    writer.add_scalar("user/after", 1.0, 0)  # the sink flushed, but did not close, our writer
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})  # 0: keep every event
    acc.Reload()
    assert "gradwatch/grad_norm_layers" in acc.Tags()["histograms"]
    hist = acc.Histograms("gradwatch/grad_norm_layers")
    assert [h.step for h in hist] == [0, 1, 2]
    assert all(h.histogram_value.num == 2 for h in hist)  # fc1 and head, not the ghost
    assert "user/after" in acc.Tags()["scalars"]


def test_csv_long_format_grows_with_late_layers(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.csv"
    sink = CSVSink(path)
    _, expected = _run(LateBranch(start=3), [sink], steps=6)
    assert sink._fh is None, "the watcher closes its sinks at exit"
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert path.read_text().splitlines()[0] == "step,metric,value"
    late_steps = [int(r["step"]) for r in rows if r["metric"] == "grad_norm/late"]
    assert late_steps == [3, 4, 5]
    body = {int(r["step"]): float(r["value"]) for r in rows if r["metric"] == "grad_norm/body"}
    assert sorted(body) == list(range(6))
    for step, value in body.items():
        assert value == pytest.approx(
            expected[step]["body"], rel=1e-6
        )  # norms accumulate in float32


def test_csv_keeps_nonfinite_values_readable(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    with CSVSink(path) as sink:
        sink.log_metrics(4, {"grad_norm/a": float("nan"), "grad_norm/b": float("inf"), "x": 0.1})
    sink.log_metrics(5, {"late": 1.0})  # after close: ignored, never raises into training
    rows = list(csv.reader(path.read_text().splitlines()))
    assert rows[0] == ["step", "metric", "value"]
    values = {m: float(v) for _, m, v in rows[1:]}
    assert math.isnan(values["grad_norm/a"]) and values["grad_norm/b"] == math.inf
    assert values["x"] == 0.1 and "late" not in values


def test_sinks_follow_the_protocol(tmp_path: Path) -> None:
    csv_sink, tb_sink = CSVSink(tmp_path / "m.csv"), TensorBoardSink(tmp_path / "tb")
    assert isinstance(csv_sink, Sink) and isinstance(tb_sink, Sink)
    csv_sink.close()
    tb_sink.close()
    tb_sink.close()  # idempotent


def test_bad_sink_arguments_fail_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        CSVSink(tmp_path)
    with pytest.raises(ConfigError, match="int"):
        CSVSink(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="SummaryWriter or a log directory, got int"):
        TensorBoardSink(42)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        TensorBoardSink(tmp_path / "file")


def test_missing_tensorboard_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install gradwatch\[tensorboard\]") as info:
        TensorBoardSink(tmp_path)
    assert isinstance(info.value, ConfigError)


def test_a_failing_sink_never_stops_training(tmp_path: Path) -> None:
    class Broken:
        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    good = CSVSink(tmp_path / "m.csv")
    w, _ = _run(GhostNet(), [Broken(), good], steps=4)
    assert w.steps == 4
    internal = w.report().by_check("internal_error")
    assert internal and "disk full" in internal[0].message
    rows = csv.reader((tmp_path / "m.csv").read_text().splitlines())
    steps = {row[0] for row in rows if row[0] != "step"}
    assert steps == {"0", "1", "2", "3"}
