"""Fault containment: a failure inside gradwatch becomes a fact judged as a finding, never a crash."""

from __future__ import annotations

import logging
import traceback
import weakref
from typing import Any, Callable

from gradwatch.capture.facts import FAULT, Fact, Report
from gradwatch.config import GradWatchConfig
from gradwatch.errors import GradWatchError, GradWatchWarning

__all__ = ["Faults"]

log = logging.getLogger("gradwatch")


class Faults:
    """Runs gradwatch's own steps guarded and records each failing place once.

    ``GradWatchError`` (``fail_fast``) and ``GradWatchWarning`` (``warnings`` as errors) are
    the user's to see and pass through; anything else is an ``internal_error`` finding and
    training goes on (unless ``on_internal_error: raise``).
    """

    def __init__(self, config: GradWatchConfig) -> None:
        self.config = config
        self._pending: list[Fact] = []
        # Where a fault is recorded: held until the run's judges are connected.
        self.report: Report = self._pending.append
        self.where: set[str] = set()
        self.step = 0  # the step an internal error is reported at (the owner keeps it current)

    def connect(self, report: Report) -> None:
        """Record faults through ``report`` from now on (and the ones held so far)."""
        self.report = report
        pending, self._pending = self._pending, []
        for fact in pending:
            report(fact)

    def guard(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or ``None`` after recording its failure."""
        try:
            return fn(*args)
        except (GradWatchError, GradWatchWarning):
            raise
        except Exception as exc:
            self.error(where, exc)
            return None

    def error(self, where: str, exc: BaseException) -> None:
        """Record a failure of gradwatch's ``where`` (one finding per place)."""
        if self.config.on_internal_error == "raise":
            raise exc
        if where in self.where:
            return
        self.where.add(where)
        summary = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
        said = _first_line(exc)
        log.warning("gradwatch internal error in %s: %s (training continues)", where, said)
        fact = Fact(
            FAULT,
            step=self.step,
            message=f"gradwatch's {where} failed with {said}; training went on without it.",
            hint="This is a gradwatch bug or a faulty sink/check: please report it with the "
            "traceback in details.",
            key=where,
            details={"where": where, "error": repr(exc), "traceback": "".join(summary)},
        )
        self.report(fact)

    def callback(self) -> Callable[[str, BaseException], None]:
        """An ``on_error(where, exc)`` for hooks, holding this object weakly."""
        wself = weakref.ref(self)

        def on_error(where: str, exc: BaseException) -> None:
            me = wself()
            if me is not None:
                me.error(where, exc)

        return on_error


# An exception's first line is enough for a message; torch's dispatcher errors run to pages
# (``details.error`` keeps the whole text).
_MAX_SAID = 200


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to ``_MAX_SAID`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= _MAX_SAID else text[: _MAX_SAID - 3] + "..."
