"""Saved reports that ``gradwatch report`` and ``--baseline`` refuse (issue 44.2, 44.3).

- A named pipe (or any file that is not a regular one) is refused at once, as config files
  are: ``open()`` on a FIFO without a writer blocked forever (the command runs in a thread
  here, so that the old hang fails the test instead of stopping the run).
- A file that is no report of this gradwatch's schema (no ``findings`` key, another
  ``schema_version``) is exit 2: every field has a default, so it read as a clean report and
  exited 0.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _loops import SideNet, batches
from torch import nn

import gradwatch
from gradwatch.cli.main import main

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")


def _failed_report(tmp_path: Path) -> dict[str, Any]:
    model = SideNet(use_side=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for x, y in batches(2, out=4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert w.report().failed
    data: dict[str, Any] = json.loads(w.report().model_dump_json())
    return data


def _main_watched(args: list[str], fifo: Path) -> int:
    """``main(args)`` in a thread: a read that blocks on ``fifo`` fails the test, not hangs it."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(main(args)), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        with open(fifo, "wb"):  # a writer that closes at once: the blocked open() returns
            pass
        thread.join(30)
        pytest.fail(f"gradwatch {' '.join(args)} blocked on a named pipe")
    return result[0]


@needs_fifo
@pytest.mark.parametrize("option", ["report", "--baseline"])
def test_a_named_pipe_is_refused_at_once(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    if option == "report":
        args = ["report", str(fifo)]
    else:
        saved = tmp_path / "saved.json"
        saved.write_text(json.dumps(_failed_report(tmp_path)), encoding="utf-8")
        args = ["report", str(saved), "--baseline", str(fifo)]
    assert _main_watched(args, fifo) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a FIFO, not a regular file" in err


def test_a_directory_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a directory, not a regular file" in err


def _mutated(tmp_path: Path, change: Any, name: str = "mutated.json") -> Path:
    data = _failed_report(tmp_path)
    change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _no_findings(data: dict[str, Any]) -> None:
    del data["findings"]


def _other_schema(data: dict[str, Any]) -> None:
    data["schema_version"] = 99
    data["problems"] = data.pop("findings")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_no_findings, "no 'findings' list"),
        (_other_schema, "schema_version 99 is not the one this gradwatch reads (1)"),
    ],
)
def test_a_file_that_is_no_report_of_this_schema_is_exit_2(
    change: Any, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _mutated(tmp_path, change)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err
    # the same file as a baseline accepts nothing: refused too, before any work
    clean = _mutated(tmp_path, lambda data: None, "clean.json")
    assert main(["report", str(clean), "--baseline", str(path)]) == 2


def test_a_report_of_this_schema_with_empty_findings_is_still_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _mutated(tmp_path, lambda data: data.update(findings=[]))
    assert main(["report", str(path)]) == 0
    # without a schema_version (written by hand) it is read as this schema's
    path = _mutated(tmp_path, lambda data: data.pop("schema_version"), "by_hand.json")
    assert main(["report", str(path)]) == 1
    assert main(["report", str(_mutated(tmp_path, lambda data: None, "clean.json"))]) == 1
