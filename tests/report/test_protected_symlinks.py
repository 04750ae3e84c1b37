"""Another user's symlink in a sticky folder is never followed by a write (issue 44.4).

A report is written to a temporary file and renamed over its target, which the kernel's
``fs.protected_symlinks`` check never sees: ``Report.write``, ``report_path`` and
``gradwatch report --junit`` apply its rule themselves. A link in a sticky world-writable
folder (``/tmp``) is followed only when the writer or the folder's owner owns it.

Creating a link owned by another user needs root (``os.lchown``); the tests that do are
skipped elsewhere. The links the writer owns are followed as before everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.cli.main import main
from gradwatch.errors import ConfigError

OTHER = 4242  # a uid that is neither the writer's nor the folder's
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="lchown to another user needs root"
)


def _report() -> gradwatch.Report:
    model = nn.Linear(4, 1)
    with gradwatch.watch(model, config={"warn": False}) as w:
        model(torch.randn(3, 4)).sum().backward()
    return w.report()


def _sticky(tmp_path: Path) -> Path:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)  # as /tmp
    return folder


def _planted(tmp_path: Path, owner: int = OTHER) -> tuple[Path, Path]:
    """A file of the writer's, and a link to it that ``owner`` planted in a sticky folder."""
    victim = tmp_path / "mine" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me", encoding="utf-8")
    link = _sticky(tmp_path) / "report.json"
    link.symlink_to(victim)
    os.lchown(link, owner, owner)
    return victim, link


@as_root
def test_report_write_refuses_another_users_link(tmp_path: Path) -> None:
    victim, link = _planted(tmp_path)
    with pytest.raises(ConfigError, match=r"fs\.protected_symlinks") as info:
        _report().write(link)
    assert "\n" not in str(info.value)
    assert victim.read_text(encoding="utf-8") == "keep me" and link.is_symlink()


@as_root
def test_report_path_through_another_users_link_fails_at_enter(tmp_path: Path) -> None:
    victim, link = _planted(tmp_path)
    model = nn.Linear(4, 1)
    with pytest.raises(ConfigError, match="symlink"):
        with gradwatch.watch(model, config={"report_path": str(link)}):
            model(torch.randn(3, 4)).sum().backward()
    assert victim.read_text(encoding="utf-8") == "keep me"


@as_root
def test_a_link_in_the_path_is_checked_too(tmp_path: Path) -> None:
    """A planted link to a folder: ``/tmp/evil/report.json`` writes into the link's target."""
    victim, _ = _planted(tmp_path)
    folder_link = victim.parents[1] / "shared" / "out"
    folder_link.symlink_to(victim.parent)
    os.lchown(folder_link, OTHER, OTHER)
    with pytest.raises(ConfigError, match="symlink"):
        _report().write(folder_link / "precious.txt")
    assert victim.read_text(encoding="utf-8") == "keep me"


@as_root
def test_cli_report_junit_refuses_another_users_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "saved.json"
    _report().write(saved)
    victim, link = _planted(tmp_path)
    assert main(["report", str(saved), "--junit", str(link)]) == 2
    assert "symlink" in capsys.readouterr().err
    assert victim.read_text(encoding="utf-8") == "keep me"


@as_root
def test_a_link_the_folders_owner_owns_is_followed(tmp_path: Path) -> None:
    victim, link = _planted(tmp_path, owner=OTHER)
    os.chown(link.parent, OTHER, OTHER)  # the folder's owner planted it: the kernel follows
    _report().write(link)
    assert victim.read_text(encoding="utf-8").startswith("{")


def test_the_writers_own_link_in_a_sticky_folder_is_followed(tmp_path: Path) -> None:
    victim = tmp_path / "store" / "report.json"
    victim.parent.mkdir()
    link = _sticky(tmp_path) / "report.json"
    link.symlink_to(victim)
    _report().write(link)
    assert link.is_symlink() and victim.read_text(encoding="utf-8").startswith("{")
