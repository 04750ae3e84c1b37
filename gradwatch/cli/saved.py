"""``gradwatch report FILE``, and the saved reports it and ``check --baseline`` read.

A saved report is data from anywhere, so it is read with care:

- only from a regular file: a FIFO would block ``open()`` forever, a device never end (it
  is opened without blocking, then looked at);
- at most :data:`MAX_REPORT_BYTES`, as config files are bounded;
- only when it is a report this gradwatch writes: its ``schema_version`` (when given) is the
  one this version reads, and it has a ``findings`` list. A file without them would read as a clean report
  (every field has a default) and ``gradwatch report`` would exit 0 on it.

Example:
    $ gradwatch report gradwatch-report.json --html report.html --junit report.xml
"""

from __future__ import annotations

import argparse
import os
import stat
from typing import Any, Optional

from gradwatch.cli._options import add_output_options, check_outputs, write_output, write_sarif
from gradwatch.cli.targets import CliError

__all__ = ["MAX_REPORT_BYTES", "add_parser", "cmd_report", "load_baseline", "read_report"]

MAX_REPORT_BYTES = 256 << 20  # a saved report read by `report`/`--baseline`, as config files are

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def _read_bytes(path: str) -> bytes:
    """The bytes of the regular file ``path`` (at most one byte past the bound)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)  # a FIFO without a writer opens at once this way
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise CliError(f"cannot read report {path!r}: it is {kind}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
        return fh.read(MAX_REPORT_BYTES + 1)


def read_report(path: str) -> Any:
    """The report saved at ``path``; :class:`CliError` (one line) when it is none."""
    from pydantic import ValidationError

    from gradwatch.config._errors import format_validation_error
    from gradwatch.report import Report

    try:
        raw = _read_bytes(path)
        if len(raw) > MAX_REPORT_BYTES:
            raise CliError(f"cannot read report {path!r}: larger than {MAX_REPORT_BYTES >> 20} MiB")
        report = Report.model_validate_json(raw.decode("utf-8"))
    except OSError as exc:
        raise CliError(f"cannot read report {path!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CliError(f"cannot read report {path!r}: not a text file") from exc
    except ValidationError as exc:
        raise CliError(
            "cannot read report: " + format_validation_error(exc, Report, source=path)
        ) from exc
    except ValueError as exc:  # a NUL byte in the path
        raise CliError(f"cannot read report {path!r}: {exc}") from exc
    _check_schema(report, path)
    return report


def _check_schema(report: Any, path: str) -> None:
    """A report of the schema this gradwatch writes, with its findings (else no verdict)."""
    problem = report.schema_problem()
    if problem is not None:
        raise CliError(f"cannot read report {path!r}: {problem}")


def load_baseline(path: Optional[str]) -> Any:
    """The saved report of ``--baseline`` (read before any training: a bad path fails fast)."""
    return None if path is None else read_report(path)


def with_baseline(report: Any, baseline: Any) -> Any:
    """``report`` with the findings of ``baseline`` accepted: only new ones fail."""
    return report if baseline is None else report.with_baseline(baseline)


def cmd_report(args: argparse.Namespace) -> int:
    """``gradwatch report FILE``: print it (and write the outputs asked); 1 when it failed."""
    from gradwatch.render.junit import write_junit

    check_outputs(
        [
            ("--html", "HTML report", args.html),
            ("--junit", "JUnit XML", args.junit),
            ("--sarif", "SARIF", args.sarif),
        ]
    )
    report = read_report(args.file)
    # The stored flag is data from a file: judge the findings against the saved fail_on.
    report.failed = bool(report.failing())
    report = with_baseline(report, load_baseline(args.baseline))
    report.print(style=args.style)
    if args.html is not None:
        write_output(f"HTML report {args.html}", report.to_html, args.html)
    if args.junit is not None:
        write_output(f"JUnit XML {args.junit}", write_junit, report, args.junit)
    write_sarif(report, args.sarif, [])
    return 1 if report.failed else 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the ``report`` subcommand on ``sub`` (the main parser's subparsers)."""
    report = sub.add_parser(
        "report",
        parents=[common],
        help="show a saved JSON report",
        description="Print a saved JSON report; exit 1 when it failed.",
    )
    report.add_argument("file", metavar="FILE", help="a JSON report (Report.write, --json)")
    report.add_argument("--html", metavar="OUT", help="also write a self-contained HTML report")
    report.add_argument("--junit", metavar="OUT", help="also write JUnit XML")
    add_output_options(report)
    report.set_defaults(func=cmd_report)
