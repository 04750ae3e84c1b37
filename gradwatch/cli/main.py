"""The ``gradwatch`` command: ``check`` a model in CI, show a saved ``report``, print a ``schema``.

Exit codes: 0 clean, 1 findings at or above ``fail_on``, 2 usage, config or target errors
(one line on stderr naming the cause; ``--verbose`` adds the traceback). ``check`` runs the
probe in a child process (see ``_isolate``): a ``sys.exit``/``os._exit``/crash inside it or
a run past ``--timeout`` is exit 2, never a pass. ``report`` and the saved reports that it and
``--baseline`` read are :mod:`gradwatch.cli.saved`'s.

Example:
    $ gradwatch check examples/ci_ghost.py:build --junit gradwatch.xml
    $ gradwatch report gradwatch-report.json --html report.html
    $ gradwatch check ci/probe.py:build --sarif gradwatch.sarif --baseline baseline.json
    $ gradwatch check ci/probe.py:build --update-baseline baseline.json
    $ gradwatch check ci/probe.py:build --select ghost_param,missing_zero_grad
    $ gradwatch explain ghost_param
    $ gradwatch schema config > gradwatch-config.schema.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Optional

from gradwatch._version import __version__
from gradwatch.cli._options import (
    Parser,
    add_output_options,
    add_selection,
    check_outputs,
    enabled,
    positive,
    publish,
    seconds,
    update_baseline,
    write_output,
)
from gradwatch.cli.saved import add_parser as add_report
from gradwatch.cli.saved import load_baseline, with_baseline
from gradwatch.cli.targets import CliError, first_line, load_target

__all__ = ["CliError", "build_parser", "load_target", "main"]

PROG = "gradwatch"
DEFAULT_TIMEOUT = 900.0  # a probe is a few steps: 15 min is a hang, long before CI's 6 h
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell shows for a reader that went away


def _cmd_check(args: argparse.Namespace) -> int:
    from gradwatch.cli._isolate import IsolationError, run_here, run_isolated
    from gradwatch.cli.probe import LOSS_NOT_DECREASING, add_finding, loss_not_decreasing
    from gradwatch.report import Report

    to_stdout = args.json == "-"
    # Before any training, a bad path fails fast: the outputs, then the baseline to read.
    check_outputs(
        [
            ("--json", "JSON report", None if to_stdout else args.json),
            ("--junit", "JUnit XML", args.junit),
            ("--sarif", "SARIF", args.sarif),
            ("--update-baseline", "baseline", args.update_baseline),
        ]
    )
    baseline = load_baseline(args.baseline)
    out = sys.stderr if to_stdout else sys.stdout  # stdout carries the JSON then
    request = {k: getattr(args, k) for k in ("target", "steps", "config", "ignore", "fail_on")}
    for key in ("verbose", "overfit_steps", "curvature", "curvature_samples", "select"):
        request[key] = getattr(args, key)
    request["ignore_checks"] = args.ignore_check
    request["probes"] = not args.no_probes
    # --overfit only produces loss_not_decreasing: a selection without it skips the phase.
    request["overfit"] = args.overfit and enabled(
        LOSS_NOT_DECREASING, args.select, args.ignore_check
    )
    try:
        if args.in_process:
            result = run_here(request, stdout_to_stderr=to_stdout)
        else:
            result = run_isolated(request, timeout=args.timeout or None, stdout_to_stderr=to_stdout)
    except IsolationError as exc:
        raise CliError(str(exc), detail=exc.detail) from None
    report = Report.model_validate_json(result["report"])
    extra: list[str] = []
    if report.curvature is not None:
        print(report.curvature.table(), file=out)
        path = report.config.report_path
        if path is not None:  # the watcher wrote it without the curvature
            write_output(f"JSON report {path}", report.write, path)
    losses: Optional[list[float]] = result["losses"]
    if losses is not None:
        extra.append(LOSS_NOT_DECREASING)
        finding = loss_not_decreasing(losses)
        if finding is not None:
            add_finding(report, finding)
            path = report.config.report_path
            if path is not None:  # the watcher wrote it before the overfit phase
                write_output(f"JSON report {path}", report.write, path)
        print(
            f"overfit: loss {losses[0]:.4g} -> {losses[-1]:.4g} over {len(losses)} steps "
            "on one batch",
            file=out,
        )
    raw = report  # the baseline to write: every finding, none marked baselined
    report = with_baseline(report, baseline)
    publish(report, args, out, to_stdout=to_stdout, extra=extra, elapsed=result["elapsed"])
    if args.update_baseline is not None:
        update_baseline(raw, args.update_baseline, out)
        return 0  # creating a baseline is never a failing run
    return 1 if report.failed else 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from gradwatch.config import GradWatchConfig
    from gradwatch.report import Report

    model = GradWatchConfig if args.which == "config" else Report
    print(json.dumps(model.model_json_schema(), indent=2))
    return 0


# -- parser --------------------------------------------------------------------------------


def build_parser() -> Parser:
    """The argument parser (subcommands ``check``, ``run``, ``report``, ``schema``, ``explain``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", help="tracebacks on errors, finding warnings"
    )
    parser = Parser(
        prog=PROG,
        description="Find the silent bugs of PyTorch training loops: ghost layers, missing "
        "zero_grad, NaN origins. Exit codes: 0 clean, 1 findings at/above fail_on, 2 errors.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_check(sub, common)
    from gradwatch.cli.run import add_parser as add_run

    add_run(sub, common)
    add_report(sub, common)
    _add_schema(sub, common)

    from gradwatch.cli.explain import add_parser as add_explain

    add_explain(sub, common)
    parser.commands = {k: v for k, v in sub.choices.items() if isinstance(v, Parser)}
    return parser


def _add_check(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``check`` subcommand: run a Probe's watched steps and report."""
    check = sub.add_parser(
        "check",
        parents=[common],
        help="run a few watched training steps of a Probe and report",
        description="Import TARGET ('path/to/file.py:factory' or 'package.module:factory'), "
        "call the factory to get a gradwatch.Probe, run --steps watched training steps "
        "(statistics on every step unless the config sets every_n_steps) and report.",
    )
    check.add_argument(
        "target", metavar="TARGET", help="path/to/file.py:factory or package.module:factory"
    )
    check.add_argument("--steps", type=positive, default=3, help="watched steps (default: 3)")
    check.add_argument(
        "--config",
        metavar="FILE",
        help="config file (.yaml/.toml/.json); replaces the Probe's config",
    )
    check.add_argument(
        "--json",
        metavar="OUT",
        help="write the JSON report here ('-': stdout; the summary then goes to stderr)",
    )
    check.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        help=f"stop the probe and exit 2 after this long (default: {DEFAULT_TIMEOUT:g}; 0: none)",
    )
    check.add_argument(
        "--junit", metavar="OUT", help="write JUnit XML here (one test case per check)"
    )
    check.add_argument(
        "--ignore",
        metavar="PATTERN",
        nargs="+",
        action="extend",
        default=[],
        help="fnmatch patterns over parameter names to allowlist (added to the config's)",
    )
    check.add_argument(
        "--fail-on",
        choices=["info", "warning", "error", "never"],
        help="fail at/above this severity (default: the config's, 'error')",
    )
    check.add_argument(
        "--overfit",
        action="store_true",
        help="also train on the first batch and report loss_not_decreasing when the loss does "
        "not fall below 0.9 x its initial value",
    )
    check.add_argument(
        "--overfit-steps", type=positive, default=30, help="steps of --overfit (default: 30)"
    )
    check.add_argument(
        "--curvature",
        action="store_true",
        help="after the steps, estimate each layer's Hessian trace and top eigenvalue on the "
        "first batch (Hessian-vector products) and add them to the report",
    )
    check.add_argument(
        "--curvature-samples",
        type=positive,
        default=16,
        help="Hutchinson probes per layer for --curvature (default: 16)",
    )
    check.add_argument(
        "--in-process",
        action="store_true",
        help="run the step in this process, not a child (for a debugger's breakpoints): a "
        "sys.exit, crash or hang in it is then not caught, and --timeout does not apply",
    )
    check.add_argument(
        "--no-probes",
        action="store_true",
        help="skip the probes run on copies of the model before the steps (gradient_mismatch, "
        "sample_dependence, does_not_learn)",
    )
    add_selection(check)
    add_output_options(check)
    check.set_defaults(func=_cmd_check)


def _add_schema(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``schema`` subcommand: print the JSON Schema of the config or the report."""
    schema = sub.add_parser(
        "schema", parents=[common], help="print the JSON Schema of the config or the report"
    )
    schema.add_argument("which", nargs="?", choices=["config", "report"], default="config")
    schema.set_defaults(func=_cmd_schema)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line and return its exit code (0 clean, 1 findings, 2 errors).

    Example:
        >>> from gradwatch.cli.main import main
        >>> main(["check", "examples/ci_clean.py:build"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # named by the subcommand it was given to, with the closest option
            parser.unknown(getattr(args, "command", None), extras)
    except SystemExit as exc:  # --help, --version, usage errors (one line, printed)
        return exc.code if isinstance(exc.code, int) else 2
    from gradwatch.errors import ConfigError

    try:
        return int(args.func(args))
    except (CliError, ConfigError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        detail = getattr(exc, "detail", "")
        if args.verbose and detail:
            print(detail, file=sys.stderr, end="")
        elif args.verbose:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gradwatch ... | head`: stop quietly, as the docs of `signal` advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE  # not 1: that means "findings", and none were judged here
    except Exception as exc:  # a gradwatch bug: still one line unless --verbose
        print(
            f"{PROG}: error: internal error: {first_line(exc)}"
            + ("" if args.verbose else " (run with --verbose for the traceback)"),
            file=sys.stderr,
        )
        if args.verbose:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        return 2
