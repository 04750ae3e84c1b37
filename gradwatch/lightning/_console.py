"""Keep gradwatch's console output out of Lightning's live progress bar.

A ``GradWatchWarning`` raised during fit is written to stderr by ``warnings.showwarning``,
in the middle of the bar's line (TQDM redraws the bar with ``\\r`` on the same terminal).
:class:`BarWarnings` shows gradwatch's warnings, and only those, through the bar's own
``print`` instead (``tqdm.write`` clears the bar, writes the line and redraws it; the rich bar
prints above itself). Every other warning, and gradwatch's when no bar is live or while
warnings are being recorded (pytest, ``pytest.warns``), goes to the ``showwarning`` that was
installed before, untouched.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Callable, Optional, TextIO

from gradwatch import GradWatchWarning

__all__ = ["BarWarnings"]

ShowWarning = Callable[..., None]


def _recording() -> bool:
    """Whether a ``warnings.catch_warnings(record=True)`` collects warnings now (pytest does
    around every test, and ``pytest.warns``): they are the recorder's, not the console's.

    Recording replaces the module's ``_showwarnmsg_impl`` function by a list's ``append``;
    the default ``showwarning`` hands each warning to it. Where that name is missing (another
    Python), warnings are left as they are.
    """
    return not isinstance(getattr(warnings, "_showwarnmsg_impl", None), types.FunctionType)


class BarWarnings:
    """While installed, ``GradWatchWarning`` lines go through a progress bar's ``print``.

    Args:
        bar: the Trainer's ``progress_bar_callback`` (a ``ProgressBar``).

    Example:
        >>> hook = BarWarnings(trainer.progress_bar_callback)  # doctest: +SKIP
        >>> hook.install(); ...; hook.remove()  # doctest: +SKIP
    """

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.previous: Optional[ShowWarning] = None
        self.hook: ShowWarning = self.show  # one bound method, so ``remove`` can compare it

    def install(self) -> None:
        """Route gradwatch's warnings through the bar from now on."""
        if self.previous is None:
            self.previous = warnings.showwarning
            warnings.showwarning = self.hook

    def remove(self) -> None:
        """Put the previous ``showwarning`` back (unless someone replaced ours since)."""
        previous, self.previous = self.previous, None
        if previous is not None and warnings.showwarning is self.hook:
            warnings.showwarning = previous

    def show(
        self,
        message: Any,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Optional[TextIO] = None,
        line: Optional[str] = None,
    ) -> None:
        """``warnings.showwarning``'s signature: gradwatch's through the bar, others as before."""
        if (
            file is None
            and issubclass(category, GradWatchWarning)
            and bool(getattr(self.bar, "is_enabled", False))
            and not _recording()
        ):
            text = warnings.formatwarning(message, category, filename, lineno, line)
            try:
                self.bar.print(text.rstrip("\n"), file=sys.stderr)
                return
            except Exception:  # a custom bar without a working print: show it as usual
                pass
        previous = self.previous
        if previous is None:  # removed while a warning was in flight
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            return
        previous(message, category, filename, lineno, file, line)
