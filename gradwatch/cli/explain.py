"""``gradwatch explain CHECK``: what a check means, why it matters, how to fix and silence it.

The text lives with each check (its ``doc``; see :mod:`gradwatch.checks.docs`). Without an
id, the command lists every documented id with its one-line summary.

Example:
    $ gradwatch explain ghost_param
    $ gradwatch explain            # every id
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import textwrap
from typing import Any

__all__ = ["add_parser", "cmd_explain"]


def _width() -> int:
    return max(60, min(shutil.get_terminal_size((100, 24)).columns, 100))


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the explanation of ``args.check`` (or the list); 2 for an unknown id."""
    from gradwatch.checks.explain import all_docs, explain_text
    from gradwatch.cli.targets import CliError

    docs = all_docs()
    if args.check is None:
        width = _width()
        pad = max(len(k) for k in docs) + 2
        for check, doc in docs.items():
            lines = textwrap.wrap(
                doc.summary,
                width=width,
                initial_indent=f"{check:<{pad}}",
                subsequent_indent=" " * pad,
                break_long_words=False,
            )
            print("\n".join(lines))
        print("\nRun 'gradwatch explain CHECK' for causes, fixes and how to silence one.")
        return 0
    text = explain_text(args.check, width=_width())
    if text is None:
        close = difflib.get_close_matches(args.check, list(docs), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise CliError(f"unknown check {args.check!r}{hint} (run 'gradwatch explain' for the list)")
    print(text, end="")
    return 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the ``explain`` subcommand on ``sub`` (the main parser's subparsers)."""
    explain = sub.add_parser(
        "explain",
        parents=[common],
        help="explain a check: meaning, causes, fix, how to silence it",
        description="Print what CHECK means, why it matters, its common causes, how to fix it "
        "and how to silence it. Without CHECK, list every check id.",
    )
    explain.add_argument("check", metavar="CHECK", nargs="?", help="a check id, e.g. ghost_param")
    explain.set_defaults(func=cmd_explain)
