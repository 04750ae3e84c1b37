"""Untrusted text made safe to print: names, messages and report fields, shown literally.

Module and parameter names are arbitrary strings (``nn.ModuleDict`` keys), and a saved report
can come from anywhere. Before any of it reaches a terminal, an HTML page, a warning or an
exception message, control characters (ANSI/OSC escapes, carriage returns, backspaces), the
Unicode bidirectional marks that reorder what a reader sees, and every other invisible
format character (zero-width spaces and joiners, U+061C, the tag characters that smuggle
hidden text) are shown as visible escapes.
Markup (``[bold]``) needs no treatment here: the console never parses text as rich markup.

Example:
    >>> safe("head\\x1b[31m")
    'head\\\\x1b[31m'
"""

from __future__ import annotations

import re

__all__ = ["NAME_LIMIT", "clip", "name", "safe"]

# C0 controls, DEL, C1 controls (Cc); every format character (Cf: the bidi marks of "Trojan
# source", zero-width spaces and joiners, U+061C, word joiners, the BOM, the tag characters);
# the line and paragraph separators (Zl, Zp: they break a one-line message); and lone
# surrogates (names decoded with os.fsdecode: no UTF-8 output can encode them). The Cf ranges
# are Unicode 15.1's, listed so that no table is built at import (a test compares them with
# ``unicodedata``).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f]"
)
#: A parameter or module name is printed whole up to this many characters (names are never
#: cut); only a longer one, from a hostile report, is shortened, keeping both of its ends.
NAME_LIMIT = 1 << 16


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe(text: object) -> str:
    """``str(text)`` with every control or bidi-override character shown as ``\\xNN``/``\\uNNNN``.

    Example:
        >>> safe("ok [/INST]")
        'ok [/INST]'
    """
    value = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escape, value) if _UNSAFE.search(value) else value


def name(text: object, limit: int = NAME_LIMIT) -> str:
    """A name made :func:`safe`, whole: only past ``limit`` characters is its middle left out,
    so that two long names ending ``.weight`` and ``.bias`` still look different.

    Example:
        >>> name("w" * 12 + ".bias", 10)
        'wwwww... (7 more characters) ....bias'
    """
    value = safe(text)
    if len(value) <= limit:
        return value
    half = limit // 2
    return f"{value[:half]}... ({len(value) - 2 * half} more characters) ...{value[-half:]}"


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
