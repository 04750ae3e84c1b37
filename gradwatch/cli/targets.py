"""Loading a ``gradwatch check`` target (``file.py:factory`` or ``pkg.module:factory``).

Every failure is a :class:`CliError`: one line naming the target and the cause.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["CliError", "first_line", "load_target"]


class CliError(Exception):
    """A one-line reason to exit with status 2 (bad target, file or option).

    ``detail`` replaces the traceback ``--verbose`` prints (the probe's child process's).
    """

    def __init__(self, line: str, *, detail: str = "") -> None:
        super().__init__(line)
        self.detail = detail


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    head = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {head}" if head else type(exc).__name__


def _import_file(path: Path, target: str) -> ModuleType:
    if not path.is_file():
        raise CliError(f"cannot import {target!r}: No such file")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # sibling imports work as when running the file as a script
        sys.path.insert(0, folder)
    name = f"_gradwatch_target_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {target!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(name, None)
        raise CliError(f"cannot import {target!r}: {first_line(exc)}") from exc
    return module


def _import_module(name: str, target: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # as `python -m` does
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as exc:
        raise CliError(f"cannot import {target!r}: {first_line(exc)}") from exc


def load_target(target: str) -> Any:
    """Import ``path/to/file.py:factory`` or ``package.module:factory`` and return its Probe.

    ``factory`` may be a dotted attribute path; it is called without arguments (a
    :class:`~gradwatch.Probe` instance itself is accepted too).

    Raises:
        CliError: one line naming the target and what went wrong.
    """
    from gradwatch.cli.probe import Probe

    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise CliError(
            f"target {target!r} must be 'path/to/file.py:factory' or 'package.module:factory'"
        )
    if where.endswith(".py") or "/" in where or os.sep in where:
        module = _import_file(Path(where), target)
    else:
        module = _import_module(where, target)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"cannot load {target!r}: {where} has no attribute {part!r}") from None
    if isinstance(obj, Probe):
        return obj
    if not callable(obj):
        raise CliError(
            f"{target!r} is a {type(obj).__name__}, not a factory returning gradwatch.Probe"
        )
    try:
        probe = obj()
    except Exception as exc:
        raise CliError(f"factory {target!r} raised {first_line(exc)}") from exc
    except SystemExit as exc:  # sys.exit(0) in a factory must not end the run as a pass
        raise CliError(f"factory {target!r} called sys.exit({exc.code!r})") from exc
    if not isinstance(probe, Probe):
        raise CliError(f"factory {target!r} returned {type(probe).__name__}, not a gradwatch.Probe")
    return probe


# -- commands ------------------------------------------------------------------------------
