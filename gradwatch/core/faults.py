"""Fault containment: a failure inside gradwatch becomes a fact judged as a finding, never a crash."""

from __future__ import annotations

import functools
import logging
import signal
import traceback
import weakref
from types import CodeType, FrameType, TracebackType
from typing import Any, Callable, Optional

from gradwatch.capture.facts import FAULT, Fact, Report
from gradwatch.config import GradWatchConfig
from gradwatch.errors import GradWatchError, GradWatchWarning

__all__ = ["Faults"]

log = logging.getLogger("gradwatch")


class Faults:
    """Runs gradwatch's own steps guarded and records each failing place once.

    ``GradWatchError`` (``fail_fast``) and ``GradWatchWarning`` (``warnings`` as errors) are
    the user's to see and pass through, and so is whatever a signal handler raised (a
    ``Preempted`` from SIGTERM, a ``TimeoutError`` from ``signal.alarm``: the handler runs in
    whichever Python frame the main thread is in, often one of gradwatch's hooks); anything
    else is an ``internal_error`` finding and training goes on (unless
    ``on_internal_error: raise``).
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
        """Record a failure of gradwatch's ``where`` (one finding per place).

        Re-raises ``exc`` when it is the user's, not gradwatch's: raised by a signal handler.
        """
        if self.config.on_internal_error == "raise" or raised_by_signal_handler(exc):
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


def raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a Python signal handler installed now.

    A handler runs on top of the frame it interrupted, so its frame is in the exception's
    traceback (between the place that caught it and the place that raised it). Only an
    exception's way out pays for this: the handlers are read here, never per step.
    """
    codes = _handler_codes()
    tb: Optional[TracebackType] = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes or _called_as_handler(tb.tb_frame):
            return True
        tb = tb.tb_next
    return False


def _called_as_handler(frame: FrameType) -> bool:
    """Whether ``frame`` is a Python signal handler's, installed or not by now.

    A handler that restores the previous one before it raises (``signal.signal(signum,
    SIG_DFL); raise Preempted``) is no longer installed when its exception is judged; the
    interpreter called it with ``(signum, frame)`` as its last two arguments, and that
    ``frame`` is the one it interrupted: its own caller.
    """
    code = frame.f_code
    if code.co_argcount < 2:
        return False
    signum_name, frame_name = code.co_varnames[code.co_argcount - 2 : code.co_argcount]
    local = frame.f_locals
    return (
        local.get(frame_name) is frame.f_back
        and frame.f_back is not None
        and type(local.get(signum_name)) is int
        and local[signum_name] in signal.valid_signals()
    )


def _handler_codes() -> set[CodeType]:
    """The code objects of the Python signal handlers installed for any signal."""
    codes: set[CodeType] = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):  # not readable here
            continue
        code = _code_of(handler)
        if code is not None:
            codes.add(code)
    return codes


def _code_of(handler: Any) -> Optional[CodeType]:
    """The code a handler runs: a function, a bound method, a ``functools.partial`` of one,
    or an object with ``__call__`` (``SIG_DFL``/``SIG_IGN``/``None``/C callables: none)."""
    for _ in range(8):  # partials of partials, bounded
        if isinstance(handler, functools.partial):
            handler = handler.func
        else:
            break
    func = getattr(handler, "__func__", handler)  # a bound method's function
    code = getattr(func, "__code__", None)
    if code is None and callable(handler) and not isinstance(handler, type):
        code = getattr(type(handler).__call__, "__code__", None)
    return code if isinstance(code, CodeType) else None


# An exception's first line is enough for a message; torch's dispatcher errors run to pages
# (``details.error`` keeps the whole text).
_MAX_SAID = 200


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to ``_MAX_SAID`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= _MAX_SAID else text[: _MAX_SAID - 3] + "..."
