"""The command line's own rules: one-line usage errors, check ids, output paths checked early.

- :class:`Parser`: an ``argparse`` parser whose errors are one line naming the culprit (no
  usage block first), with a pointer to ``--help``; an unknown option gets the closest known
  one (``did you mean --fail-on?``). The exit status stays argparse's 2.
- :func:`select_ids` / :func:`ignore_ids`: the ``type=`` of ``--select`` and
  ``--ignore-check``: comma-separated check ids, each one known (else the closest ids are
  named). gradwatch's own checks (:data:`~gradwatch.checks.registry.SELF_CHECKS`) are always
  on: selecting one is allowed (a no-op), ignoring one is a usage error.
- :func:`check_outputs`: every output path of a command can be written, checked before any
  work (a probe can take minutes; its result must not be lost to a typo in ``--json``).
- :func:`write_output` / :func:`write_sarif`: an output written, its failure one line;
  :func:`add_output_options`: ``--sarif``, ``--baseline``, ``--style`` of ``check`` and
  ``report``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tempfile
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

from gradwatch._text import safe
from gradwatch.cli.targets import CliError, first_line

__all__ = [
    "Parser",
    "add_output_options",
    "add_selection",
    "check_outputs",
    "enabled",
    "ignore_ids",
    "positive",
    "publish",
    "seconds",
    "select_ids",
    "update_baseline",
    "write_output",
    "write_sarif",
]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, exit status 2.

    ``commands`` maps each subcommand to its parser (filled by ``build_parser``), so that an
    unknown option is reported by the subcommand it was given to.
    """

    commands: dict[str, Parser]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.commands = {}

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE; see 'PROG --help'`` (one line) and exit 2."""
        # safe(): an argument holding a newline or an escape sequence stays one plain line.
        self.exit(2, f"{self.prog}: error: {safe(message)}; see '{self.prog} --help'\n")

    def unknown(self, command: Optional[str], extras: Sequence[str]) -> NoReturn:
        """Report the first argument no parser took (``parse_known_args``'s leftovers)."""
        parser = self.commands.get(command or "", self)
        options = [a for a in extras if a.startswith("-") and a != "-"]
        if not options:
            parser.error(f"unexpected argument {extras[0]!r}")
        name = options[0].split("=", 1)[0]
        close = difflib.get_close_matches(name, parser.option_names(), n=1, cutoff=0.6)
        parser.error(f"unknown option {name}" + (f" (did you mean {close[0]}?)" if close else ""))

    def option_names(self) -> list[str]:
        """Every option string of this parser (``--steps``, ``-v``, ...)."""
        return [s for action in self._actions for s in action.option_strings]


# -- check ids -------------------------------------------------------------------------------


def _ids() -> tuple[list[str], set[str]]:
    """Every id ``--select`` knows (registry order, then the CLI's own), and the self-checks."""
    from gradwatch.checks.docs import DOCS
    from gradwatch.checks.registry import ALL_CHECKS, SELF_CHECKS

    ids = [cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS]]
    return [*ids, *(k for k in DOCS if k not in ids)], {cls.id for cls in SELF_CHECKS}


def _parse_ids(text: str) -> list[str]:
    known, _ = _ids()
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise argparse.ArgumentTypeError(f"expected check ids separated by commas, got {text!r}")
    for check_id in ids:
        if check_id not in known:
            close = _close(check_id, known)
            hint = (
                f"did you mean {', '.join(close)}?" if close else "'gradwatch explain' lists them"
            )
            raise argparse.ArgumentTypeError(f"unknown check id {check_id!r} ({hint})")
    return ids


def _close(word: str, known: Sequence[str]) -> list[str]:
    """The known ids closest to ``word``: the best match and those nearly as close (at most 3).

    Example:
        >>> _close("ghost_params", ["ghost_param", "stale_param", "dead_param"])
        ['ghost_param']
    """
    ratios = [(difflib.SequenceMatcher(None, word, k).ratio(), k) for k in known]
    ranked = sorted((r for r in ratios if r[0] >= 0.6), key=lambda r: -r[0])
    return [k for r, k in ranked[:3] if r >= ranked[0][0] - 0.1]


def select_ids(text: str) -> list[str]:
    """``--select ID,...``: known check ids (gradwatch's own ones are allowed: always on)."""
    return _parse_ids(text)


def ignore_ids(text: str) -> list[str]:
    """``--ignore-check ID,...``: known check ids, none of gradwatch's own (always on)."""
    ids = _parse_ids(text)
    _, own = _ids()
    for check_id in ids:
        if check_id in own:
            raise argparse.ArgumentTypeError(
                f"{check_id!r} is one of gradwatch's own checks and always on (it says when "
                "gradwatch itself missed something); it cannot be ignored"
            )
    return ids


def enabled(check_id: str, select: Optional[Sequence[str]], ignore: Sequence[str]) -> bool:
    """Whether ``--select``/``--ignore-check`` leave ``check_id`` on (an id in both is off).

    Example:
        >>> enabled("a", ["a", "b"], ["b"]), enabled("b", ["a", "b"], ["b"]), enabled("c", None, [])
        (True, False, True)
    """
    return (select is None or check_id in select) and check_id not in ignore


def positive(text: str) -> int:
    """``type=`` of a count option: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    """``type=`` of ``--timeout``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_selection(check: argparse.ArgumentParser) -> None:
    """``--select``, ``--ignore-check`` and ``--update-baseline`` of ``check``."""
    check.add_argument(
        "--select",
        metavar="ID,...",
        type=select_ids,
        action="extend",
        # The self-checks' ids are written out (a test keeps them true): the registry would
        # import torch for every --help.
        help="run and report only these checks (comma-separated ids; repeatable). Replaces "
        "the config's 'enabled' flags: a selected check runs even where the config turns it "
        "off; gradwatch's own checks (internal_error, param_outside_model) always run",
    )
    check.add_argument(
        "--ignore-check",
        metavar="ID,...",
        type=ignore_ids,
        action="extend",
        default=[],
        help="turn these checks off (comma-separated ids; repeatable), on top of the config "
        "or --select; an id in both is off. 'gradwatch explain' lists the ids",
    )
    check.add_argument(
        "--update-baseline",
        metavar="FILE",
        help="write this run's report here as the baseline for --baseline and exit 0 even "
        "with findings (target, config and usage errors still exit 2)",
    )


# -- output paths ----------------------------------------------------------------------------


def _check_output(option: str, what: str, path: str) -> str:
    """The real path ``path`` writes to; :class:`CliError` when it cannot be written."""
    from gradwatch.errors import ConfigError
    from gradwatch.report_io import resolve_output

    label = f"{what} ({option})"
    shown = f"'{safe(path)}'"  # escaped, so that a newline cannot cut the one-line error
    try:
        real = resolve_output(path, what=label)  # a folder, device, FIFO, NUL byte: refused
        folder = real.parent
        existing = folder
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise CliError(f"cannot write {label} {shown}: '{safe(existing)}' is not a folder")
        if existing == folder:  # what the atomic write does: a temporary file there
            fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=folder)
            os.close(fd)
            os.unlink(tmp)
        elif not os.access(existing, os.W_OK | os.X_OK):  # its folders would be created here
            raise CliError(
                f"cannot write {label} {shown}: cannot create folders in '{safe(existing)}' "
                "(Permission denied)"
            )
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # a name too long, a read-only file system, no permission
        raise CliError(f"cannot write {label} {shown}: {exc.strerror or exc}") from None
    return os.fspath(real)


def check_outputs(outputs: Sequence[tuple[str, str, Optional[str]]]) -> None:
    """Fail now when an output cannot be written, or two outputs write one file.

    Args:
        outputs: ``(option, what, path)`` for each output option; ``path`` ``None`` when the
            option was not given. Nothing is left behind (folders are not created yet).

    Raises:
        CliError: one line naming the option, the path and the reason.
    """
    seen: dict[str, str] = {}
    for option, what, path in outputs:
        if path is None:
            continue
        real = _check_output(option, what, path)
        if real in seen:
            raise CliError(f"{seen[real]} and {option} both write '{safe(path)}'")
        seen[real] = option


def write_output(what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)``, which writes ``what``; its failure is a one-line CliError."""
    what = safe(what)  # a newline in an output path must not cut the one-line error
    try:
        fn(*args, **kwargs)
    except ImportError as exc:
        raise CliError(f"cannot write {what}: {first_line(exc)}") from exc
    except OSError as exc:
        raise CliError(f"cannot write {what}: {exc.strerror or exc}") from exc


def write_sarif(report: Any, path: Optional[str], extra: list[str]) -> None:
    """Write ``report`` as SARIF to ``path`` when one was given."""
    if path is not None:
        from gradwatch.render.sarif import write_sarif as write

        write_output(f"SARIF {path}", write, report, path, extra_checks=extra)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--sarif``, ``--baseline`` and ``--style``, shared by ``check`` and ``report``."""
    parser.add_argument(
        "--sarif", metavar="OUT", help="also write SARIF 2.1.0 here (GitHub code scanning)"
    )
    parser.add_argument(
        "--baseline",
        metavar="FILE",
        help="a saved JSON report: its findings do not fail the run, new ones do (matched by "
        "check and layer/parameters, not by step)",
    )
    parser.add_argument(
        "--style",
        choices=["diagnostic", "table"],
        default="diagnostic",
        help="console output: a block per finding (default) or a compact table",
    )


def publish(
    report: Any,
    args: argparse.Namespace,
    out: Any,
    *,
    to_stdout: bool,
    extra: list[str],
    elapsed: float,
) -> None:
    """Print ``report`` and write the ``--json``/``--junit``/``--sarif`` (``--html`` where the
    command has it) of ``check`` and ``run``."""
    import sys

    report.print(file=out, style=args.style)
    if to_stdout:
        print(report.model_dump_json(indent=2), flush=True, file=sys.stdout)
    elif args.json is not None:
        write_output(f"JSON report {args.json}", report.write, args.json)
    if getattr(args, "html", None) is not None:
        write_output(f"HTML report {args.html}", report.to_html, args.html)
    if args.junit is not None:
        from gradwatch.render.junit import write_junit

        write_output(
            f"JUnit XML {args.junit}",
            write_junit,
            report,
            args.junit,
            extra_checks=extra,
            time=elapsed,
        )
    write_sarif(report, args.sarif, extra)


def update_baseline(report: Any, path: str, out: Any) -> None:
    """Write ``report`` (every finding, none marked baselined) as the baseline at ``path``."""
    from gradwatch.checks.not_observed import NotObserved

    write_output(f"baseline {path}", report.write, path)
    n = len(report.findings)
    line = (
        f"baseline: wrote {n} finding{'' if n == 1 else 's'} to {safe(path)}; runs with "
        f"--baseline {safe(path)} fail on new findings only"
    )
    if report.by_check(NotObserved.id):
        line += f" (a {NotObserved.id} finding is never accepted: the run was not judged)"
    print(line, file=out)
