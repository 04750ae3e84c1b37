"""Untrusted text made safe to print: names, messages and report fields, shown literally.

Module and parameter names are arbitrary strings (``nn.ModuleDict`` keys), and a saved report
can come from anywhere. Before any of it reaches a terminal, a warning or an exception
message, control characters (ANSI/OSC escapes, carriage returns, backspaces) and the Unicode
bidirectional overrides that reorder what a reader sees are shown as visible escapes.
Markup (``[bold]``) needs no treatment here: the console never parses text as rich markup.

Example:
    >>> safe("head\\x1b[31m")
    'head\\\\x1b[31m'
"""

from __future__ import annotations

import re

__all__ = ["clip", "safe"]

# C0 controls, DEL, C1 controls, the bidi embedding/override/isolate marks ("Trojan source"),
# and lone surrogates (names decoded with os.fsdecode: no UTF-8 output can encode them).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(text: object) -> str:
    """``str(text)`` with every control or bidi-override character shown as ``\\xNN``/``\\uNNNN``.

    Example:
        >>> safe("ok [/INST]")
        'ok [/INST]'
    """
    value = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escape, value) if _UNSAFE.search(value) else value


def clip(text: str, limit: int = 4000) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out.

    A saved report can hold a message of any length (100 MiB): what is printed is bounded.

    Example:
        >>> clip("x" * 10, 4)
        'xxxx... (6 more characters)'
    """
    return (
        text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
    )
