"""Keep ``report_path`` current during the run, so a preempted job still leaves a report.

The file is rewritten atomically when a finding appears or changes severity, every
``report_every_n_steps`` steps, and on SIGTERM (cluster preemption, time limits) before the
user's own handler runs. SIGKILL cannot be caught: the last refresh is what remains.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["ReportRefresher"]


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
