"""Report files: atomic, through symlinks, never onto devices/FIFOs/folders, checked at attach."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.cli.main import main
from gradwatch.errors import ConfigError
from gradwatch.render.junit import write_junit
from gradwatch.render.sarif import write_sarif
from gradwatch.report_io import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]


def small_report() -> gradwatch.Report:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return w.report()


WRITERS = {
    "json": lambda report, path: report.write(path),
    "junit": lambda report, path: write_junit(report, path),
    "sarif": lambda report, path: write_sarif(report, path),
}


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_symlink_target_is_updated_and_the_link_kept(kind: str, tmp_path: Path) -> None:
    real = tmp_path / "store" / "report.out"
    real.parent.mkdir()
    real.write_text("old", encoding="utf-8")
    os.chmod(real, 0o640)
    link = tmp_path / "link.out"
    link.symlink_to(real)
    WRITERS[kind](small_report(), link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text(encoding="utf-8") != "old" and "gradwatch" in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o640  # the file keeps its permissions
    assert sorted(p.name for p in real.parent.iterdir()) == ["report.out"]  # no temp files


def test_a_dangling_symlink_gets_its_target_created(tmp_path: Path) -> None:
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "runs" / "7.json")
    small_report().write(link)
    assert link.is_symlink() and gradwatch.Report.read(tmp_path / "runs" / "7.json").steps == 2


def _non_regular(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a private copy of /dev/null or /dev/full: never touch the real device nodes
        numbers = {"dev_null": (1, 3), "dev_full": (1, 7)}[kind]
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(*numbers))
        except PermissionError:
            pytest.skip("creating a device node needs root")
    return path


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_null", "dev_full"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("via_link", [False, True])
def test_non_regular_targets_are_refused_and_left_alone(
    kind: str, writer: str, via_link: bool, tmp_path: Path
) -> None:
    target = _non_regular(tmp_path, kind)
    before = os.stat(target)
    path = target
    if via_link:
        path = tmp_path / "link"
        path.symlink_to(target)
    with pytest.raises(ConfigError) as err:
        WRITERS[writer](small_report(), path)  # a FIFO must not block either
    line = str(err.value)
    assert "\n" not in line and str(path) in line and "not a regular file" in line
    after = os.stat(target)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_nul_byte_in_the_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="NUL byte"):
        write_text_atomic("a\x00b.json", "{}")


def test_cli_refuses_a_directory_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "r.json"
    small_report().write(src)
    (tmp_path / "out.xml").mkdir()
    assert main(["report", str(src), "--junit", str(tmp_path / "out.xml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "out.xml" in err and "a directory" in err


# -- report_path is checked when watching starts -------------------------------------------


@pytest.mark.parametrize("where", ["under_a_file", "a_directory", "a_fifo"])
def test_an_unwritable_report_path_fails_at_attach(where: str, tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    path = {
        "under_a_file": blocker / "report.json",
        "a_directory": tmp_path,
        "a_fifo": _non_regular(tmp_path, "fifo"),
    }[where]
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(model, config={"report_path": str(path)}).attach()
    assert "report_path" in str(err.value) and "\n" not in str(err.value)
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing was hooked
    gradwatch.watch(model).attach().close()  # and the model is not left "already watched"


def test_a_writable_report_path_leaves_nothing_at_attach(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "dir" / "r.json"
    w = gradwatch.watch(nn.Linear(2, 1), config={"report_path": str(out)}).attach()
    assert list(out.parent.iterdir()) == []
    w.close()


# -- a full disk and a read-only folder, in a private mount namespace -----------------------

_DISK_SCRIPT = textwrap.dedent(
    """
    import errno, os, subprocess, sys
    from pathlib import Path
    import torch
    from torch import nn
    import gradwatch
    from gradwatch.errors import ConfigError
    from gradwatch.render.junit import write_junit

    full, ro = Path(sys.argv[1]), Path(sys.argv[2])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
    report = w.report()
    report.write(full / "r.json")
    write_junit(report, full / "r.xml")
    good_json, good_xml = (full / "r.json").read_text(), (full / "r.xml").read_text()

    with open(full / "filler", "wb", buffering=0) as fh:  # fill the disk up
        try:
            while True:
                fh.write(b"x" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    big = report.model_copy(update={"findings": []})
    big.layers = big.layers * 2000  # far more than the space left
    for write in (lambda: big.write(full / "r.json"), lambda: write_junit(big, full / "r.xml")):
        try:
            write()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise AssertionError("the write should have failed")
    assert (full / "r.json").read_text() == good_json  # the good old report survives
    assert (full / "r.xml").read_text() == good_xml
    assert sorted(p.name for p in full.iterdir()) == ["filler", "r.json", "r.xml"]

    try:
        gradwatch.watch(nn.Linear(2, 1), config={"report_path": str(ro / "r.json")}).attach()
    except ConfigError as exc:
        assert "report_path" in str(exc) and "Read-only file system" in str(exc), exc
    else:
        raise AssertionError("a read-only report_path was accepted")
    print("DISK-OK")
    """
)


def _unshare() -> list[str]:
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs Linux unshare(1)")
    for cmd in (["unshare", "-m", "--propagation", "private"], ["unshare", "-rm"]):
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    pytest.skip("cannot make a private mount namespace here (needs root or user namespaces)")


def test_a_full_disk_keeps_the_old_report_and_a_read_only_dir_fails_at_attach(
    tmp_path: Path,
) -> None:
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    proc = subprocess.run(
        [*_unshare(), sys.executable, "-c", _DISK_SCRIPT, str(full), str(ro)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0 and "DISK-OK" in proc.stdout, proc.stderr[-3000:]
    assert list(full.iterdir()) == []  # the tmpfs lived only in that namespace


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda data: data.update(schema_version=99), "schema_version 99"),
        (lambda data: data.pop("findings"), "no 'findings' list"),
    ],
    ids=["unknown-schema", "no-findings"],
)
def test_report_read_refuses_what_would_read_as_a_pass(
    tmp_path: Path, edit: object, problem: str
) -> None:
    """``Report.read`` applies the CLI's schema checks: such a file is no clean report."""
    import json

    path = tmp_path / "r.json"
    data = json.loads(small_report().model_dump_json())
    data["failed"] = False
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=problem):
        gradwatch.Report.read(path)
    assert main(["report", str(path)]) == 2  # the CLI says the same, through the same check
