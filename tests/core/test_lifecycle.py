"""A watched model can be copied and pickled; the watcher's lifecycle holds up (issue 16: 1, 5, 7).

Real pickling, deep copies, ``AveragedModel``, ``mp.spawn``, signals sent to a child process
running a real loop: no mocks.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _loops import batches, ghosts, mlp
from torch import nn

import gradwatch


class WithAux(nn.Module):
    """A trunk that trains and an auxiliary head the training forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x).mean(dim=1, keepdim=True)


def _pickle_loads_without_gradwatch(data: bytes, tmp_path: Path) -> None:
    """Unpickle in a fresh interpreter where ``import gradwatch`` is impossible."""
    blob = tmp_path / "model.pkl"
    blob.write_bytes(data)
    code = textwrap.dedent(
        f"""
        import sys, pickle
        sys.modules["gradwatch"] = None  # any reference to gradwatch fails to load
        import torch
        m = pickle.loads(open({str(blob)!r}, "rb").read())
        m["trunk"](torch.randn(2, 8)).sum().backward()
        print("loaded", type(m).__name__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded" in out.stdout


def test_watched_model_pickles_and_loads_without_gradwatch(tmp_path: Path) -> None:
    # torch classes only, so that the child interpreter can load it without this test file
    model = nn.ModuleDict({"trunk": nn.Linear(8, 1), "aux": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(model["trunk"](x), y).backward()
            opt.step()
            data = pickle.dumps(model)  # mid-run, every hook installed
            buf = io.BytesIO()
            torch.save(model, buf)
    assert b"gradwatch" not in data.replace(b"gradwatch.detached_forward_hook", b"")
    _pickle_loads_without_gradwatch(data, tmp_path)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded["aux"](torch.randn(2, 8))
    assert ghosts(w.report()) == {"aux.weight", "aux.bias"}


def test_deepcopy_forwards_do_not_corrupt_the_originals_causes() -> None:
    model = WithAux()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        twin = copy.deepcopy(model)  # e.g. an EMA copy made while watched
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            twin.aux(twin.trunk(x)).sum().backward()  # the copy's aux runs: not the original's
    (ghost,) = w.report().by_check("ghost_param")
    assert ghost.module == "aux" and ghost.details["cause"] == "not_called"
    assert not twin.aux._forward_hooks  # the copy's hook left at its first call
    assert not twin.trunk._forward_hooks
    pickle.dumps(twin)


def test_averaged_model_of_a_watched_model_trains_and_pickles() -> None:
    from torch.optim.swa_utils import AveragedModel

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        ema = AveragedModel(model)
        for x, y in batches(5):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ema.update_parameters(model)
            with torch.no_grad():
                ema(x)
    assert not w.report().failed
    pickle.dumps(ema)
    assert not any(m._forward_hooks for m in model.modules())  # removed on exit


def _spawned(rank: int, model: nn.Module, out: str) -> None:
    x = torch.randn(4, 8)
    Path(out, f"rank{rank}").write_text(str(float(model(x).sum())))


@pytest.mark.slow
def test_mp_spawn_with_a_watched_model(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt):
        mp.spawn(_spawned, args=(model, str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


class HoldsModel(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.full((8,), float(i)))


@pytest.mark.slow
def test_spawn_dataloader_whose_dataset_holds_the_watched_model() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt):
        loader = torch.utils.data.DataLoader(
            HoldsModel(model), batch_size=2, num_workers=1, multiprocessing_context="spawn"
        )
        assert len(list(loader)) == 2


def test_nested_with_closes_only_at_the_outermost_exit() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = gradwatch.watch(model, opt, config={"every_n_steps": 1})
    with w:
        with w:
            train_steps(model, opt, 2)
        train_steps(model, opt, 2)  # still watched after the inner exit
        assert model[0]._forward_hooks
    assert w.report().steps == 4
    assert not model[0]._forward_hooks


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for x, y in batches(n):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


class ClippedSGD(torch.optim.SGD):
    """An optimizer subclass whose step calls the parent's step (torch wraps both)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        return super().step(closure)


def test_subclass_calling_super_step_is_one_step() -> None:
    model = mlp()
    torch.optim.SGD(mlp().parameters(), lr=0.1)  # the parent class is instantiated (patched) too
    opt = ClippedSGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        train_steps(model, opt, 5)
    report = w.report()
    assert report.steps == 5 and report.backward_passes == 5
    assert not report.failed, [f.line() for f in report.findings]


def test_a_step_that_raised_does_not_swallow_the_next_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    boom = {"on": True}

    def flaky(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if boom.pop("on", False):
            raise RuntimeError("user hook fails once")

    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        opt.register_step_pre_hook(flaky)
        with pytest.raises(RuntimeError, match="fails once"):
            train_steps(model, opt, 1)
        train_steps(model, opt, 3)
    assert w.report().steps == 3


def test_replacing_the_optimizer_mid_run_is_said() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        train_steps(model, opt, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)  # e.g. rebuilt per epoch
        train_steps(model, opt, 4)
    report = w.report()
    assert report.failed and report.steps == 3
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "optimizer_0_not_stepping"
    assert "re-created" in f.hint


def test_gradient_accumulation_and_lbfgs_are_not_unwatched_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(12)):
            nn.functional.mse_loss(model(x), y).backward()
            if k % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert not w.report().by_check("not_observed")
    model = mlp()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    x, y = batches(1)[0]

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with gradwatch.watch(model, lbfgs) as w:
        for _ in range(3):
            lbfgs.step(closure)
    report = w.report()
    assert report.steps == 3 and not report.by_check("not_observed")


class MaxNormEmbedder(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place, in every
    forward: its weight's version moves across backward passes with no optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 4, max_norm=1.0)
        self.head = nn.Linear(4 * 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).flatten(1))


def _token_loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return model(torch.randint(0, 50, (8, 6), generator=g)).pow(2).mean()


@pytest.mark.parametrize("replaced", [False, True])
def test_a_forward_that_edits_a_weight_in_place_is_no_unwatched_optimizer(
    replaced: bool,
) -> None:
    torch.manual_seed(0)
    model = MaxNormEmbedder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k in range(40):
            if replaced and k == 8:
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # unwatched from here
            (_token_loss(model, k) / 8).backward()
            if k % 8 == 7:
                opt.step()
                opt.zero_grad()
    report = w.report()
    reasons = [f.details["reason"] for f in report.by_check("not_observed")]
    assert reasons == (["optimizer_0_not_stepping"] if replaced else []), reasons
    assert report.steps == (1 if replaced else 5)


def test_model_ran_but_nothing_was_observed_never_passes() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for x, _ in batches(3):
            model(x)  # forward only: no backward, no step
    report = w.report()
    assert report.failed
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "no_step" and f.severity == "error"


def test_a_loop_that_forgets_optimizer_step_never_passes() -> None:
    """Backward passes and zero_grad, never step(): nothing trains, nothing is checked."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
    report = w.report()
    assert report.failed and report.steps == 0
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "no_step" and f.details["backward_passes"] == 4
    assert "never stepped" in f.message and "optimizer.step()" in f.hint


def test_a_step_that_raises_before_the_optimizer_leaves_no_pass() -> None:
    """A wrapper whose step raised before reaching the optimizer (Opacus on a parameter
    without a gradient): the report written at exit says nothing was checked."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = gradwatch.watch(model, opt)
    with pytest.raises(RuntimeError, match="before the step"):
        with w:
            x, y = batches(1)[0]
            nn.functional.mse_loss(model(x), y).backward()
            raise RuntimeError("the wrapper failed before the step")
    assert [f.details["reason"] for f in w.report().by_check("not_observed")] == ["no_step"]


def test_steps_a_grad_scaler_skipped_are_not_a_forgotten_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with gradwatch.watch(model, opt, scaler=scaler) as w:
        for x, y in batches(2):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * float("inf")  # every step skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = w.report()
    # Not a forgotten step; but nothing trained, so no pass either (issue 44.2).
    reasons = [f.details["reason"] for f in report.by_check("not_observed")]
    assert report.skipped_steps == 2 and reasons == ["all_steps_skipped"]


def test_watcher_whose_model_never_ran_does_not_pass() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt) as w:
        pass
    report = w.report()
    assert report.failed
    (f,) = report.findings
    assert f.check == "not_observed" and f.details["reason"] == "never_ran"


def test_watcher_whose_copy_trained_does_not_pass() -> None:
    """The usual way to train something else than the watched model: a copy made after watch()."""
    model = mlp()
    with gradwatch.watch(model) as w:
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        train_steps(twin, opt, 2)
    assert [f.details["reason"] for f in w.report().by_check("not_observed")] == ["never_ran"]


def test_hooks_failing_on_every_step_is_not_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import gradwatch.core.steps

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(gradwatch.core.steps, "gather", boom)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(gradwatch.GradWatchWarning), gradwatch.watch(model, opt) as w:
        train_steps(model, opt, 3)
    report = w.report()
    assert report.failed
    (f,) = report.by_check("not_observed")
    assert f.details["reason"] == "hooks_failed"


def test_report_path_is_refreshed_during_the_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    model = WithAux()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"report_path": str(out), "report_every_n_steps": 2}
    with gradwatch.watch(model, opt, config=cfg):
        train_steps(model, opt, 1)
        first = gradwatch.Report.read(out)  # written at the first step (a new finding)
        assert first.steps == 1 and ghosts(first) == {"aux.weight", "aux.bias"}
        train_steps(model, opt, 4)
        assert gradwatch.Report.read(out).steps >= 4


CHILD = """
import os, signal, sys, time, torch
from torch import nn
import gradwatch
mode, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "chain":
    def mine(signum, frame):
        open(marker, "w").write("user handler ran")
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
extra = nn.Linear(8, 1)
model.add_module("unused", extra)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
every = 1000 if mode != "kill" else 3
with gradwatch.watch(model, opt, config={"report_path": out, "report_every_n_steps": every}):
    step = 0
    while True:
        opt.zero_grad()
        model[1](model[0](torch.randn(4, 8))).sum().backward()
        opt.step()
        step += 1
        if step == 20:
            open(marker + ".ready", "w").write("1")
        time.sleep(0.005)
"""


def _run_child(tmp_path: Path, mode: str, sig: int) -> tuple[int, Path, Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out, marker = tmp_path / "report.json", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(out), str(marker)],
        env=env,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not Path(str(marker) + ".ready").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    proc.stderr.close()  # type: ignore[union-attr]
    return code, out, marker


@pytest.mark.slow
def test_sigterm_writes_the_report_then_default_action(tmp_path: Path) -> None:
    code, out, _ = _run_child(tmp_path, "default", signal.SIGTERM)
    assert code == -signal.SIGTERM
    report = gradwatch.Report.read(out)
    assert report.steps >= 20 and ghosts(report) == {"unused.weight", "unused.bias"}


@pytest.mark.slow
def test_sigterm_chains_the_users_handler(tmp_path: Path) -> None:
    code, out, marker = _run_child(tmp_path, "chain", signal.SIGTERM)
    assert code == 3 and marker.read_text() == "user handler ran"
    assert gradwatch.Report.read(out).steps >= 20


@pytest.mark.slow
def test_sigkill_leaves_the_last_refreshed_report(tmp_path: Path) -> None:
    code, out, _ = _run_child(tmp_path, "kill", signal.SIGKILL)
    assert code == -signal.SIGKILL
    report = gradwatch.Report.read(out)
    assert report.steps >= 18 and ghosts(report) == {"unused.weight", "unused.bias"}
    json.loads(out.read_text())  # a whole file: writes are atomic
