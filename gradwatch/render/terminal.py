"""The one console both text styles print through: a ``rich`` Console, and word wrapping by rich.

Colour and terminal detection are rich's: a terminal (``isatty``), ``FORCE_COLOR``, ``NO_COLOR``
and ``TERM=dumb`` as rich reads them. Without colour the output is plain text, no escape code at
all (bold included). Every name and text is a ``rich.text.Text``, never markup: a parameter named
``[bold]x`` prints as ``[bold]x``. Lines are wrapped by ``Text.wrap`` on word boundaries; a word
longer than the room left (a long parameter name, a path) is kept whole on a line of its own
width, never split, and the console never crops it (``soft_wrap``).

Example:
    >>> console = make_console(io.StringIO(), color=False, width=80)  # doctest: +SKIP
    >>> console.print(hanging(Text("a long line ..."), 80, indent=2), soft_wrap=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

__all__ = ["DEFAULT_WIDTH", "hanging", "longest_word", "make_console", "width_for"]

#: The width when the output is no terminal (a CI log, a pipe) and ``COLUMNS`` is unset.
DEFAULT_WIDTH = 110
_MIN_ROOM = 20  # a wrapped text gets at least this many columns after its indent


def make_console(file: Any, *, color: Optional[bool], width: Optional[int]) -> Console:
    """A Console on ``file`` that never parses markup, emoji codes or highlights.

    Args:
        file: where to write.
        color: ``True`` forces standard ANSI colours, ``False`` plain text; ``None`` lets rich
            decide (a terminal, ``FORCE_COLOR``, ``NO_COLOR``, ``TERM=dumb``).
        width: the line width; ``None``: :func:`width_for`.
    """
    from rich.console import Console

    options: dict[str, Any] = {
        "file": file,
        "highlight": False,
        "markup": False,
        "emoji": False,
        "soft_wrap": False,
    }
    if color is None:
        probe = Console(**options)
        color = (
            probe.is_terminal
            and not probe.is_dumb_terminal
            and not probe.no_color
            and probe.color_system is not None
        )
        system = probe.color_system if color else None
    else:
        system = "standard" if color else None
    console = Console(
        **options,
        width=width if width is not None else width_for(file),
        color_system=system,  # type: ignore[arg-type]  # rich's ColorSystem names
        force_terminal=bool(color),
    )
    return console


def width_for(file: Any) -> int:
    """``COLUMNS``, else the terminal's width when ``file`` is one, else :data:`DEFAULT_WIDTH`."""
    from rich.console import Console

    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        terminal = bool(file.isatty())
    except (AttributeError, ValueError, OSError):
        terminal = False
    return Console(file=file).width if terminal else DEFAULT_WIDTH


def longest_word(text: str) -> int:
    """The cell width of the longest whitespace-separated word of ``text`` (0 when none)."""
    from rich.cells import cell_len

    return max((cell_len(word) for word in text.split()), default=0)


def hanging(
    text: Text,
    width: int,
    *,
    indent: int = 2,
    first: Optional[Text] = None,
    rest: Optional[Text] = None,
) -> list[Text]:
    """``text`` word-wrapped by rich to ``width``: continuation lines indented by ``indent``.

    ``first`` (a label such as ``"   params: "``, as wide as ``indent``) starts the first line,
    ``rest`` (``indent`` spaces by default) each other line. A word longer than the room is
    never split: the room grows to hold it.
    """
    from rich.console import Console
    from rich.text import Text

    lead = first if first is not None else Text()
    bar = rest if rest is not None else Text(" " * indent)
    longest = longest_word(text.plain)
    out: list[Text] = []
    while True:
        room = max(width - (len(lead) if not out else len(bar)), _MIN_ROOM, longest)
        lines = text.wrap(Console(width=room + len(bar) + len(lead)), room, overflow="fold")
        if not out and len(lines) > 1:  # the first line is wider: wrap the rest again
            line = lines[0]
            text = text[len(line.plain) :]
            text = text[len(text.plain) - len(text.plain.lstrip()) :]
            line.rstrip()
            out.append(lead.copy().append_text(line) if len(lead) else line)
            continue
        for line in lines or [Text()]:
            line.rstrip()
            prefix = lead if not out else bar
            out.append(prefix.copy().append_text(line) if len(prefix) else line)
        return out
