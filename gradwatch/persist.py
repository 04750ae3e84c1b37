"""Keep ``report_path`` current during the run (the watcher's, outside the run's core: it needs
only the report and its writer), so a preempted job still leaves a report.

One watcher writes one file: a second one created with the same ``report_path`` while the
first is not closed yet (entered or not: two models trained in two threads from one YAML) is a
:class:`~gradwatch.errors.ConfigError` (whichever exited last would win, so a failed run's
file could say ``failed: false``). The claim is taken under a lock, so two threads creating
watchers at once cannot both take it.

The file is rewritten atomically when a finding appears or changes severity, every
``report_every_n_steps`` steps, and on SIGTERM (cluster preemption, time limits) before the
user's own handler runs. SIGKILL cannot be caught: the last refresh is what remains.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from gradwatch.errors import ConfigError
from gradwatch.report_io import check_report_path, write_watched_report

if TYPE_CHECKING:
    from gradwatch.config import GradWatchConfig
    from gradwatch.report import Report

__all__ = ["ReportRefresher", "holding_interrupts", "write_outputs"]

# The real path of each report file -> the refresher of the live watcher that writes it.
_WRITERS: weakref.WeakValueDictionary[str, ReportRefresher] = weakref.WeakValueDictionary()
_CLAIMS = threading.Lock()


class ReportRefresher:
    """Rewrites the report file as the run goes; chains the previous SIGTERM handler."""

    def __init__(self, path: Optional[Path], every_n_steps: int, write: Callable[[], None]):
        self.path = path
        self.every = every_n_steps
        self._write = write
        self._revision = -1
        self._written_at = 0
        self._previous: Any = None
        self._installed = False
        self._claimed: Optional[str] = None

    @classmethod
    def claimed(
        cls, path: Optional[Path], every_n_steps: int, write: Callable[[], None]
    ) -> ReportRefresher:
        """A refresher that owns ``path`` from now on: claimed when its watcher is created,
        not when it is entered (two watchers made before either enters)."""
        check_report_path(path)
        refresher = cls(path, every_n_steps, write)
        refresher.claim()
        return refresher

    def claim(self) -> None:
        """Be the one writer of the report file (until :meth:`release`)."""
        if self.path is None:
            return
        key = os.path.realpath(self.path)
        with _CLAIMS:
            if self._taken(key):
                gc.collect()  # a watcher dropped unclosed may sit in a reference cycle
            if self._taken(key):
                raise ConfigError(
                    f"report_path {os.fspath(self.path)!r} is the report of another live "
                    "watcher (created and not closed yet): give each watcher its own "
                    "report_path, or close the other first"
                )
            _WRITERS[key] = self
            self._claimed = key

    def _taken(self, key: str) -> bool:
        """Another refresher holds ``key`` (a test kept in its own frame: an error's
        traceback must not keep the other watcher alive)."""
        other = _WRITERS.get(key)
        return other is not None and other is not self

    def release(self) -> None:
        """Give the report file up: the watcher wrote it for the last time."""
        with _CLAIMS:
            key, self._claimed = self._claimed, None
            if key is not None and _WRITERS.get(key) is self:
                del _WRITERS[key]

    def install(self) -> None:
        """Handle SIGTERM (main thread only: Python allows signal handlers nowhere else)."""
        if self.path is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        except (ValueError, OSError):  # not allowed here (embedded interpreters)
            self._installed = False

    def uninstall(self) -> None:
        """Put the previous handler back, unless someone replaced ours since."""
        if not self._installed:
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)

    def maybe_refresh(self, step: int, revision: int) -> None:
        """Write when the findings changed or ``every`` steps passed since the last write."""
        if self.path is None:
            return
        if revision != self._revision or step - self._written_at >= self.every:
            self._revision, self._written_at = revision, step
            self._write()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        try:
            self._write()
        finally:
            previous = self._previous
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                # The default action (terminate) as if we had never been there.
                self.uninstall()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)


def write_outputs(final: Optional[Report], config: GradWatchConfig, rank0: bool) -> None:
    """At exit: the JSON report where the config asks, the console summary on rank 0."""
    if final is None:
        return
    if config.report_path is not None:
        write_watched_report(final, config.report_path)
    if config.console and rank0:
        final.print()


def holding_interrupts(close: Callable[..., None]) -> Callable[..., None]:
    """``close``, with Ctrl-C held until it is done, then raised.

    A Ctrl-C storm (one interrupt stops the loop, the next lands in the exit) would stop the
    final report half-way: no file, or the last refresh left standing as if the run were
    clean. A held interrupt is raised as ``KeyboardInterrupt`` once the report is written.
    Only Python's own SIGINT handler is replaced, only in the main thread: a user's handler
    keeps its meaning.
    """

    @functools.wraps(close)
    def held(*args: Any, **kwargs: Any) -> None:
        held_now: list[int] = []

        def hold(signum: int, frame: Any) -> None:
            held_now.append(signum)

        try:
            mine = threading.current_thread() is threading.main_thread() and (
                signal.getsignal(signal.SIGINT) is signal.default_int_handler
            )
            if mine:
                signal.signal(signal.SIGINT, hold)
        except (ValueError, OSError):  # not allowed here (embedded interpreters)
            mine = False
        try:
            close(*args, **kwargs)
        finally:
            if mine and signal.getsignal(signal.SIGINT) is hold:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if held_now:
                raise KeyboardInterrupt

    return held
