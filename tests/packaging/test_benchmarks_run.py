"""The overhead benchmark runs end to end (``--quick``) and reports every variant."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.capture.grads.step_reading import PACE

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = [
    "baseline",
    "clip_grad_norm",
    "lightning_grad_norm",
    "item_loop",
    "noop_hooks",
    "gradwatch_default",
    "gradwatch_every_step",
    "gradwatch_hooks_only",
    "gradwatch_without_new",
]


@pytest.mark.slow  # a subprocess importing torch and Lightning, 8 variants: ~15-20 s
def test_quick_benchmark_writes_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "overhead.py"),
        "--quick",
        "--blocks",
        "2",
        "--warmup",
        "0",
        "--block",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["machine"]["torch_num_threads"] == 1
    assert data["machine"]["cpu"] and data["machine"]["torch"]
    res = data["models"]["a"]
    assert res["param_tensors"] == 400
    assert list(res["variants"]) == EXPECTED
    for name, row in res["variants"].items():
        assert row["samples"] == 2, name
        assert row["ms_per_step"] > 0 and math.isfinite(row["added_ms"]), name
    assert res["variants"]["baseline"]["added_ms"] == 0.0
    assert [b["line"].split()[0] for b in res["budget"]] == ["default", "every", "hooks"]
    assert "gradwatch_default" in proc.stdout and "x clip" in proc.stdout


def test_kernel_table_runs_and_names_every_piece() -> None:
    """``benchmarks/kernels.py`` on small tensors: every piece timed, the ratio printed."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py")]
    cmd += ["--count", "3", "--size", "70000", "--repeat", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    # clip, 3 pieces, sum, the fingerprint read afresh, 2 floors
    assert len(lines) == 9 and "3 x 70,000 float32" in lines[0]
    assert "one chunked pass" in lines[2] and "checksum carried" in lines[3]
    assert "clip_grad_norm_" in lines[1] and "x clip_grad_norm_" in lines[-4]
    assert "reading its checksums" in lines[-3]
    assert "floor with L1 instead" in lines[-2] and "L2 norms alone" in lines[-1]
    assert all(float(line.split()[0]) >= 0 for line in lines[1:])


def test_breakdown_names_every_phase_part_and_the_collector() -> None:
    """``benchmarks/breakdown.py``, a short run: each phase, the parts, the checks and the GC."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "breakdown.py")]
    cmd += ["--warm", "20", "--steps", "4", "--gc-steps", "4", "--floor", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for phase in ("zero_grad", "forward", "backward", "step", "x clip"):
        assert f"| {phase}" in out or phase in out
    for part in ("StepPipeline.decide", "gather", "Judges.step", "check ghost_param"):
        assert f"| {part} |" in out
    assert "scan steps" in out and "steady state" in out and "garbage collector" in out
    assert "place: the watched copy, bare before attaching" in out


def test_turns_pairs_both_paces_and_swaps_them() -> None:
    """``benchmarks/turns.py``, a short run: the three paired lines, each with both halves."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "turns.py"), "--steps", "3", "--warm", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "3 steps a copy in each half" in lines[0]
    assert "PACE 1" in lines[1] and f"PACE {PACE}" in lines[2] and "minus PACE 1" in lines[3]
    assert all("(halves " in line for line in lines[1:4])


def test_since_attach_gives_every_step_and_the_timed_block() -> None:
    """``benchmarks/since_attach.py``, a short run: a row per block of steps, each step's
    figure, and overhead.py's timed block beside the late steps."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "since_attach.py"), "--epochs", "2"]
    proc = subprocess.run(
        [*cmd, "--steps", "32"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "2 attaches" in lines[0]
    rows = [line for line in lines if line.lstrip().startswith("steps ")]
    assert [r.split(":")[0].split()[1] for r in rows] == ["0-", "10-", "20-", "30-"]
    assert sum(len(r.split("   ")[-1].split()) for r in rows) == 32  # one figure per step
    assert lines[-1].startswith("overhead.py's timed block (steps 20-29)")


@pytest.mark.slow  # 18 combinations of dtype x optimizer x model, each interleaving 4 variants
def test_gpu_script_runs_every_combination_on_the_cpu() -> None:
    """``benchmarks/gpu.py --cpu-dry-run``: the GPU script's own code, where no GPU is."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--cpu-dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["device"] == "cpu (dry run)"
    runs = summary["runs"]
    assert len(runs) == 2 * 3 * 3  # model kinds x dtypes x optimizers
    assert summary["errors"] == 0, [r["error"] for r in runs if "error" in r]
    for row in runs:
        variants = row["time"]["added_ms"]
        assert list(variants) == ["baseline", "clip", "gradwatch_default", "gradwatch_every_step"]
        assert all(math.isfinite(v) for v in variants.values()), row


def test_check_flags_a_ratio_past_its_tolerance(tmp_path: Path) -> None:
    """``overhead.py --check`` (issue 49): a ratio above tolerance x its committed figure is
    REGRESSED; within it, ok; variants the committed file lacks are not compared."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _check import compare
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def run(**ratios: float) -> dict[str, object]:
        rows = {name: {"x_clip": x} for name, x in ratios.items()}
        return {"models": {"a": {"variants": rows}}}

    committed = tmp_path / "results.json"
    committed.write_text(json.dumps(run(gradwatch_default=1.0, gradwatch_every_step=2.0)))
    lines, ok = compare(
        run(gradwatch_default=1.4, gradwatch_every_step=3.5, gradwatch_new=9.0, baseline=0.0),
        committed,
        tolerance=1.5,
    )
    assert not ok
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["ok", "REGRESSED"]
    assert "gradwatch_every_step 3.50x clip (committed 2.00x, limit 3.00x)" in lines[1]
    lines, ok = compare(run(gradwatch_default=0.5), tmp_path / "missing.json", tolerance=1.5)
    assert ok and "cannot read" in lines[0]
    none = {"models": {"a": {"variants": {"gradwatch_default": {"x_clip": None}}}}}
    lines, ok = compare(none, committed, tolerance=1.5)  # clip's added time came out <= 0
    assert ok and lines == [
        "overhead check: (a) gradwatch_default: no ratio, clip_grad_norm_'s added time was "
        "not above zero in this run (a noisy host)"
    ]


@pytest.mark.slow  # a subprocess: seven hook states and two watched runs of model (a), ~15 s
def test_backward_hooks_names_every_hook_state_and_phase() -> None:
    """``benchmarks/backward_hooks.py``, a short run: each hook state, each phase, twice."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "backward_hooks.py"), "--passes", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    states = ("post", "post removed", "pre removed", "pre released", "node removed", "node kept")
    for state in states:
        assert f"  {state} " in out, state
    assert out.count("step (gradwatch's decision)") == 3
    assert "every_n_steps=1," in out and "every_n_steps=10," in out
    assert "light arrival hooks" in out and "post arrival hooks only" in out


def test_median_windows_compares_both_layouts_warm_and_evicted() -> None:
    """``benchmarks/median_windows.py``, a short run: both layouts agree value for value
    (it asserts so) and each cache state gets a line."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "median_windows.py"),
        *("--layers", "20", "--history", "16", "--steps", "60"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["warm", "evicted"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
