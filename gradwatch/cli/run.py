"""``gradwatch run SCRIPT [ARGS...]``: an unmodified training script, watched.

The script runs in this process as ``python SCRIPT ARGS`` would run it: ``sys.argv`` is
``[SCRIPT, *ARGS]``, ``__name__`` is ``"__main__"``, ``sys.path[0]`` is the script's folder,
the working directory is left alone. :mod:`gradwatch.cli._run_discovery` finds the models
and optimizers it builds and a watcher is entered at the first iteration boundary. When the
script ends (normally, by an exception, ``sys.exit`` or Ctrl-C) the report is printed and the
outputs are written as ``check`` writes them.

Exit codes: the script's own non-zero exit wins (an uncaught exception: 1, with its
traceback; Ctrl-C: 130); else 1 on findings at or above ``fail_on``, else 0. A script that
is missing or cannot be compiled: 2, one line naming it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from typing import Any, Optional

from gradwatch._text import safe
from gradwatch.cli._options import (
    add_output_options,
    add_selection,
    check_outputs,
    publish,
    update_baseline,
)
from gradwatch.cli.targets import CliError, first_line

__all__ = ["add_parser"]

PROBES = ("auto", "on", "off")
LIGHTNING_NOTE = (
    "gradwatch run: this is a Lightning script; gradwatch.lightning.GradWatchCallback is the "
    "better path there (it watches from the first step and knows the trainer's steps); "
    "watched here from the second iteration on"
)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand."""
    run = sub.add_parser(
        "run",
        parents=[common],
        help="run an unmodified training script with watching attached and report",
        description="Run SCRIPT as 'python SCRIPT ARGS...' would (same sys.argv, __main__, "
        "working directory), watching the models and optimizers it builds from its second "
        "iteration on; print the report when it ends. Options go before SCRIPT; everything "
        "after it is the script's.",
    )
    run.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments")
    run.add_argument("--config", metavar="FILE", help="config file (.yaml/.toml/.json)")
    run.add_argument(
        "--json",
        metavar="OUT",
        help="write the JSON report here ('-': stdout; the summary then goes to stderr)",
    )
    run.add_argument("--html", metavar="OUT", help="write a self-contained HTML report here")
    run.add_argument("--junit", metavar="OUT", help="write JUnit XML here (one case per check)")
    run.add_argument(
        "--fail-on",
        choices=["info", "warning", "error", "never"],
        help="fail at/above this severity (default: the config's, 'error')",
    )
    run.add_argument(
        "--probes",
        choices=PROBES,
        help="the loss-free probes watch() runs on the first batch (default: the config's)",
    )
    add_selection(run)
    add_output_options(run)
    run.set_defaults(func=_cmd_run)


def _script(path: str) -> Any:
    """The compiled script; :class:`CliError` when it is missing or cannot start."""
    shown = f"'{safe(path)}'"
    if not os.path.exists(path):
        raise CliError(f"cannot run script {shown}: no such file")
    if not os.path.isfile(path):
        raise CliError(f"cannot run script {shown}: not a file")
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        return compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise CliError(
            f"cannot run script {shown}: {type(exc).__name__}: {exc.msg} (line {exc.lineno})"
        ) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot run script {shown}: {first_line(exc)}") from None


def _config(args: argparse.Namespace) -> Any:
    from gradwatch.cli.probe import resolve_config
    from gradwatch.config import GradWatchConfig

    cfg = resolve_config(
        args.config,
        fail_on=args.fail_on,
        every_n_steps=None,
        warn=False,
        select=args.select,
        ignore_checks=args.ignore_check,
    )
    if args.probes is not None and "probes" in GradWatchConfig.model_fields:
        data = cfg.model_dump(exclude_unset=True)
        data["probes"] = args.probes
        cfg = GradWatchConfig.coerce(data)
    return cfg


def _cmd_run(args: argparse.Namespace) -> int:
    import time

    from gradwatch.cli.saved import load_baseline, with_baseline

    code_obj = _script(args.script)
    to_stdout = args.json == "-"
    check_outputs(
        [
            ("--json", "JSON report", None if to_stdout else args.json),
            ("--html", "HTML report", args.html),
            ("--junit", "JUnit XML", args.junit),
            ("--sarif", "SARIF", args.sarif),
            ("--update-baseline", "baseline", args.update_baseline),
        ]
    )
    baseline = load_baseline(args.baseline)
    cfg = _config(args)
    from gradwatch.cli._run_session import Session

    session = Session(cfg)
    pid = os.getpid()
    began = time.monotonic()
    exit_code = _run_script(args.script, code_obj, args.args, session)
    if os.getpid() != pid:  # a forked child that returned here: it never reports
        os._exit(exit_code or 0)
    report = session.finish()
    out = sys.stderr if to_stdout else sys.stdout
    if session.lightning:
        print(LIGHTNING_NOTE, file=out)
    raw = report
    report = with_baseline(report, baseline)
    publish(report, args, out, to_stdout=to_stdout, extra=[], elapsed=time.monotonic() - began)
    if args.update_baseline is not None:
        update_baseline(raw, args.update_baseline, out)
    if exit_code:
        return exit_code
    return 0 if args.update_baseline is not None else int(report.failed)


def _run_script(path: str, code_obj: Any, argv: list[str], session: Any) -> Optional[int]:
    """Run the script as ``__main__``; its exit code (``None``: it ended normally)."""
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [path, *argv]
    folder = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)
    session.install()
    try:
        _exec_main(path, code_obj)
        return None
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        print("gradwatch run: interrupted (Ctrl-C); reporting what was watched", file=sys.stderr)
        return 130
    except BaseException as exc:  # the script's own uncaught exception: printed as Python would
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path and tb.tb_next:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1
    finally:
        session.remove()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0


def _exec_main(path: str, code_obj: Any) -> None:
    """Run the script as ``__main__`` (``runpy`` recompiles it: ``code_obj`` only checked it)."""
    del code_obj
    runpy.run_path(path, run_name="__main__")


def _exit_code(code: object) -> int:
    """What Python's exit status is for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    print(code, file=sys.stderr)
    return 1
