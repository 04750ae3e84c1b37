"""A bad gradwatch config given to the callback on a command line (``LightningCLI``,
``jsonargparse.CLI``): one ``error:`` line that names the file, and exit status 2."""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any

from gradwatch.errors import ConfigError

__all__ = ["built_by_argument_parser", "exit_as_cli"]


def built_by_argument_parser() -> bool:
    """Whether jsonargparse (``LightningCLI``, ``jsonargparse.CLI``) is building this callback."""
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return False
        if str(frame.f_globals.get("__name__", "")).startswith("jsonargparse."):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def exit_as_cli(exc: ConfigError, config: Any = None) -> None:
    """A bad gradwatch config under a command line: one ``error:`` line and exit status 2.

    jsonargparse would wrap the exception into a union-of-types error of some 90 lines with
    the reason in the middle; a command line reports a bad argument in one line, as
    ``argparse`` does, and so does gradwatch's own CLI. A config path that is not there is
    named as the working directory resolved it, with the nearest file name beside it.
    """
    sys.stderr.write(f"error: gradwatch.lightning.GradWatchCallback: {exc}{_where(config)}\n")
    raise SystemExit(2) from None


def _where(config: Any) -> str:
    """For a config path that does not exist: where it was looked for, and a close name."""
    if not isinstance(config, (str, os.PathLike)):
        return ""
    path = Path(config)
    try:
        if path.exists():
            return ""
        full = Path(os.path.normpath(path if path.is_absolute() else Path.cwd() / path))
        folder = full.parent
        names = [n.name for n in folder.iterdir()] if folder.is_dir() else None
    except OSError:
        return ""
    said = "" if path.is_absolute() else ", from the working directory"
    if names is None:
        near = f"; no folder {str(folder)!r}"
    else:
        close = difflib.get_close_matches(full.name, names, n=1, cutoff=0.6)
        near = f"; did you mean {str(folder / close[0])!r}?" if close else ""
    return f" (looked for {str(full)!r}{said}{near})"
