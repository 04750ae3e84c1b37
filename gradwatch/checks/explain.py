"""``gradwatch explain``'s text, SARIF rule help and the HTML's links, built from the registry.

Each check documents itself (its ``doc``, a :class:`~gradwatch.checks.docs.CheckDoc`) and
declares its default severity once (its ``Config``'s ``severity`` default);
:data:`~gradwatch.checks.docs.DOCS` holds the ids without a check class (the CLI's).

Example:
    >>> lookup("ghost_param").summary
    'A trainable parameter got no gradient between two optimizer steps while others did.'
    >>> default_severity("ghost_param"), default_severity("param_outside_model")
    ('error', 'info')
"""

from __future__ import annotations

import re
import textwrap
from typing import Optional

from gradwatch.checks.docs import DOCS, CheckDoc
from gradwatch.checks.registry import ALL_CHECKS, SELF_CHECKS, by_id

__all__ = ["all_docs", "default_severity", "explain_text", "lookup", "maturity", "maturity_text"]


def lookup(check_id: str) -> Optional[CheckDoc]:
    """The documentation of ``check_id``: the check class's ``doc``, else :data:`DOCS`."""
    for cls in [*ALL_CHECKS, *SELF_CHECKS]:
        if cls.id == check_id and cls.doc is not None:
            return cls.doc
    return DOCS.get(check_id)


def default_severity(check_id: str) -> Optional[str]:
    """The default severity of ``check_id``: its check's ``Config`` default, else its DOCS entry's."""
    try:
        return by_id(check_id).default_severity()
    except KeyError:
        doc = DOCS.get(check_id)
        return None if doc is None else doc.severity


def maturity(check_id: str) -> Optional[str]:
    """``"stable"`` or ``"preview"`` (the check's ``maturity``); ``None`` for an id without a
    check class (the CLI's)."""
    try:
        return by_id(check_id).maturity
    except KeyError:
        return None


def maturity_text(check_id: str) -> Optional[str]:
    """One sentence on ``check_id``'s maturity, as ``explain`` and the docs page say it."""
    stage = maturity(check_id)
    if stage == "preview":
        return (
            "Maturity: preview. Not yet proven on the clean corpus of correct programs: its "
            "findings are info (marked preview) unless the config sets `preview: true`, "
            "which gives them their own severity."
        )
    if stage == "stable":
        return (
            "Maturity: stable. The clean corpus of correct programs gives it no warning or "
            "error; its findings carry their severity."
        )
    return None


def all_docs() -> dict[str, CheckDoc]:
    """Every documented id: the registered checks in their order, then the rest of DOCS."""
    out = {cls.id: cls.doc for cls in [*ALL_CHECKS, *SELF_CHECKS] if cls.doc is not None}
    for key, doc in DOCS.items():
        out.setdefault(key, doc)
    return out


_GLUE = "\x00"  # a space inside a `code span`: the span is copied as a whole, never split


def _para(text: str, width: int, indent: str = "  ", bullet: str = "") -> list[str]:
    glued = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", _GLUE), text)
    lines = textwrap.wrap(
        glued,
        width=width,
        initial_indent=indent + bullet,
        subsequent_indent=indent + " " * len(bullet),
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace(_GLUE, " ") for line in lines]


def explain_text(check_id: str, *, width: int = 100) -> Optional[str]:
    """What ``gradwatch explain CHECK`` prints, wrapped to ``width``; ``None`` for an unknown id.

    Example:
        >>> print(explain_text("ghost_param").splitlines()[0])
        ghost_param (default severity: error)
    """
    doc = lookup(check_id)
    if doc is None:
        return None
    width = max(width, 40)
    lines = [f"{check_id} (default severity: {default_severity(check_id)})", ""]
    lines += _para(doc.summary, width, indent="")
    stage = maturity_text(check_id)
    if stage:
        lines += ["", *_para(stage, width, indent="")]
    lines += ["", "Why it matters:", *_para(doc.why, width)]
    lines += ["", "Common causes:"]
    for cause in doc.causes:
        lines += _para(cause, width, bullet="- ")
    lines += ["", "How to fix:", *_para(doc.fix, width)]
    lines += ["", "How to silence it:"]
    for way in doc.silencing(check_id):
        lines += _para(way, width, bullet="- ")
    return "\n".join(lines) + "\n"
