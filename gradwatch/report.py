"""The report: pydantic models that round-trip through JSON.

Example:
    >>> report = watcher.report()  # doctest: +SKIP
    >>> report.failed, [f.check for f in report.findings]  # doctest: +SKIP
    (True, ['ghost_param'])
    >>> report.write("gradwatch-report.json")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from gradwatch._text import safe
from gradwatch.checks.not_observed import NotObserved
from gradwatch.checks.registry import error_class
from gradwatch.errors import ConfigError
from gradwatch.render.console import print_report, render_text
from gradwatch.render.html import notebook_html, write_html
from gradwatch.report_io import write_text_atomic
from gradwatch.results import (
    SCHEMA_VERSION,
    Coverage,
    Curvature,
    Finding,
    LayerCurvature,
    LayerStats,
    ReportData,
)

__all__ = [
    "SCHEMA_VERSION",
    "Coverage",
    "Curvature",
    "Finding",
    "LayerCurvature",
    "LayerStats",
    "Report",
]


class Report(ReportData):
    """Everything a watcher found. ``Report.model_validate_json(report.model_dump_json())`` round-trips."""

    def with_baseline(self, baseline: Report) -> Report:
        """A copy where the findings already in ``baseline`` are accepted: they fail nothing.

        Findings match on :meth:`Finding.key` (check and layer or parameters), never on step
        numbers. Accepted ones get ``details.baselined = True``; ``failed`` is recomputed
        from the others, so only new findings fail the run. A ``not_observed`` finding is
        never accepted: a run that was not observed cannot be baselined into a pass.

        Example:
            >>> old = Report.read("gradwatch-baseline.json")  # doctest: +SKIP
            >>> watcher.report().with_baseline(old).failed  # doctest: +SKIP
            False
        """
        known = {f.key() for f in baseline.findings}
        out = self.model_copy(deep=True)
        for f in out.findings:
            # A fresh dict each: findings copied from one another may share theirs.
            details = {k: v for k, v in f.details.items() if k != "baselined"}
            if f.key() in known and f.check != NotObserved.id:
                details["baselined"] = True
            f.details = details
        out.failed = bool(out.failing())
        return out

    def raise_for_findings(self) -> None:
        """Raise when the report failed.

        Raises:
            GhostLayerError: when a failing finding is ``ghost_param``.
            GradWatchError: for any other failing finding.
        """
        failing = self.failing()
        if not failing:
            return
        lines = "; ".join(f.line() + f" [{safe(', '.join(f.params[:8]))}]" for f in failing)
        cls = error_class(f.check for f in failing)
        raise cls(f"gradwatch found {len(failing)} problem(s): {lines}")

    def write(self, path: Union[str, Path]) -> Path:
        """Write the JSON report atomically (temp file + rename) and return its path.

        A symlink's target is updated; a path that is not a regular file (a device, a FIFO,
        a folder) is refused. See :func:`gradwatch.report_io.write_text_atomic`.

        Raises:
            ConfigError: ``path`` is not a regular file.
            OSError: the write failed; a previous report at ``path`` is left whole.
        """

        return write_text_atomic(path, self.model_dump_json(indent=2), what="JSON report")

    @classmethod
    def read(cls, path: Union[str, Path]) -> Report:
        """Load a report written by :meth:`write`.

        Raises:
            ConfigError: the file is no report this gradwatch writes (another
                ``schema_version``, or no ``findings`` list): it must not read as a pass.
            pydantic.ValidationError: the JSON does not fit the report's fields.
        """
        report = cls.model_validate_json(Path(path).read_text(encoding="utf-8"))
        problem = report.schema_problem()
        if problem is not None:
            raise ConfigError(f"cannot read report {str(path)!r}: {problem}")
        return report

    def summary(self, *, color: bool = False, width: int = 110, style: str = "diagnostic") -> str:
        """The console rendering as text: one block per finding, or ``style="table"``."""

        return render_text(self, color=color, width=width, style=style)

    def print(self, file: Any = None, *, style: str = "diagnostic") -> None:
        """Print the findings to ``file`` (stdout by default), in colour on a terminal.

        ``style="diagnostic"`` (default) prints one compiler-style block per finding;
        ``style="table"`` a compact table.

        Example:
            >>> report.print(style="table")  # doctest: +SKIP
        """

        print_report(self, file=file, style=style)

    def to_html(self, path: Union[str, Path]) -> Path:
        """Write a self-contained HTML report with plots (needs ``matplotlib``)."""

        return write_html(self, Path(path))

    def _repr_html_(self) -> str:
        """Jupyter's rich display: status, findings table and coverage (no charts)."""

        return notebook_html(self)

    def __str__(self) -> str:
        return self.summary()
