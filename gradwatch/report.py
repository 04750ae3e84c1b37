"""The report: pydantic models that round-trip through JSON.

Example:
    >>> report = watcher.report()  # doctest: +SKIP
    >>> report.failed, [f.check for f in report.findings]  # doctest: +SKIP
    (True, ['ghost_param'])
    >>> report.write("gradwatch-report.json")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from gradwatch._severity import FailOn, Severity, at_least
from gradwatch._text import safe
from gradwatch.config import GradWatchConfig
from gradwatch.errors import GhostLayerError, GradWatchError

__all__ = [
    "SCHEMA_VERSION",
    "Coverage",
    "Curvature",
    "Finding",
    "LayerCurvature",
    "LayerStats",
    "Report",
]

SCHEMA_VERSION = 1

# NaN/Inf norms are data here (a NaN gradient is what the report is about): keep them in JSON.
_JSON = ConfigDict(ser_json_inf_nan="constants")


class Finding(BaseModel):
    """One problem, at most one per (check, layer), with when and how often it was seen."""

    model_config = _JSON

    check: str
    severity: Severity
    message: str
    hint: str = ""
    params: list[str] = Field(default_factory=list)
    module: Optional[str] = None
    first_step: int = 0
    last_step: int = 0
    count: int = 1
    details: dict[str, Any] = Field(default_factory=dict)

    def cause(self) -> str:
        """The short "why" of the finding: ``details.cause``, else ``details.origin``, else ""."""
        for key in ("cause", "origin"):
            value = self.details.get(key)
            if value:
                return str(value)
        return ""

    def line(self) -> str:
        """A one-line rendering: ``[severity] check module: message`` (control bytes escaped)."""
        where = f" {self.module}" if self.module else ""
        return safe(f"[{self.severity}] {self.check}{where}: {self.message}")

    def key(self) -> tuple[str, ...]:
        """What identifies this finding across runs: check and layer (or parameters), no steps."""
        if self.module:
            return (self.check, "module", self.module)
        if self.params:
            return (self.check, "params", *sorted(self.params))
        other = self.details.get("where") or self.details.get("reason") or self.cause()
        return (self.check, "other", str(other))

    def baselined(self) -> bool:
        """Whether a baseline accepted this finding (``details.baselined``): it fails nothing."""
        return self.details.get("baselined") is True


class LayerStats(BaseModel):
    """Statistics of one layer (a module that directly owns parameters)."""

    model_config = _JSON

    name: str
    params: list[str]
    numel: int
    trainable: bool = True
    in_optimizer: bool = True
    grad_norm_last: Optional[float] = None
    grad_norm_min: Optional[float] = None
    grad_norm_max: Optional[float] = None
    grad_norm_mean: Optional[float] = None
    mean_abs_grad: Optional[float] = None
    max_abs_grad: Optional[float] = None
    zero_fraction: Optional[float] = None
    param_norm: Optional[float] = None
    update_ratio: Optional[float] = None
    steps_with_grad: int = 0
    steps_without_grad: int = 0
    forward_order: Optional[int] = None
    history: list[tuple[int, float]] = Field(
        default_factory=list, description="(step, gradient L2 norm) samples, bounded."
    )

    # Short aliases for the gradient-norm summary (SPEC §3: ``last/min/max/mean``).
    @property
    def last(self) -> Optional[float]:
        return self.grad_norm_last

    @property
    def min(self) -> Optional[float]:
        return self.grad_norm_min

    @property
    def max(self) -> Optional[float]:
        return self.grad_norm_max

    @property
    def mean(self) -> Optional[float]:
        return self.grad_norm_mean


class Coverage(BaseModel):
    """Which parameters train, which are frozen, which an optimizer holds."""

    trainable: int = 0
    frozen: int = 0
    trainable_numel: int = 0
    frozen_numel: int = 0
    in_optimizer: int = 0
    not_in_optimizer: int = 0
    frozen_in_optimizer: int = 0
    outside_model: int = 0
    optimizers: int = 0


class LayerCurvature(BaseModel):
    """Curvature of the loss in one layer's parameters: its diagonal block of the Hessian."""

    model_config = _JSON

    name: str
    params: list[str]
    numel: int
    trace: float = Field(
        description="Hutchinson estimate of the trace of the layer's Hessian block."
    )
    trace_stderr: float = Field(
        description="Standard error of `trace` (sample std / sqrt(samples))."
    )
    trace_per_param: float = Field(description="trace / numel: the mean curvature per parameter.")
    top_eigenvalue: float = Field(
        description="Eigenvalue of largest magnitude of the block (power iteration; signed)."
    )
    power_iters: int = Field(description="Hessian-vector products the power iteration used.")


class Curvature(BaseModel):
    """Per-layer curvature from Hessian-vector products (``gradwatch.sensitivity``).

    Example:
        >>> curv = gradwatch.sensitivity(model, batch, loss_fn)  # doctest: +SKIP
        >>> curv.ranked()[0].name  # doctest: +SKIP
        'head'
    """

    model_config = _JSON

    loss: float
    samples: int
    seed: int
    hvps: int = Field(description="Hessian-vector products computed in total.")
    layers: list[LayerCurvature] = Field(default_factory=list)

    def ranked(self) -> list[LayerCurvature]:
        """Layers by curvature per parameter, most sensitive first."""
        return sorted(self.layers, key=lambda c: -abs(c.trace_per_param))

    def table(self) -> str:
        """A plain-text table, most sensitive layer first."""
        rows = [
            f"{'layer':<32} {'numel':>10} {'trace':>11} {'+/-':>9} {'per param':>10} {'top eig':>10}"
        ]
        for c in self.ranked():
            rows.append(
                f"{c.name[:32]:<32} {c.numel:>10,} {c.trace:>11.4g} {c.trace_stderr:>9.2g} "
                f"{c.trace_per_param:>10.4g} {c.top_eigenvalue:>10.4g}"
            )
        return "\n".join(rows)


class Report(BaseModel):
    """Everything a watcher found. ``Report.model_validate_json(report.model_dump_json())`` round-trips."""

    model_config = _JSON

    schema_version: int = SCHEMA_VERSION
    gradwatch_version: str
    torch_version: str
    config: GradWatchConfig
    steps: int = 0
    backward_passes: int = 0
    skipped_steps: int = 0
    failed: bool = False
    fail_on: FailOn = "error"
    findings: list[Finding] = Field(default_factory=list)
    layers: list[LayerStats] = Field(default_factory=list)
    coverage: Coverage = Field(default_factory=Coverage)
    param_map: Optional[dict[str, Any]] = None
    curvature: Optional[Curvature] = None

    def failing(self) -> list[Finding]:
        """The findings at or above ``fail_on`` (except those a baseline accepted)."""
        return [
            f for f in self.findings if at_least(f.severity, self.fail_on) and not f.baselined()
        ]

    def by_check(self, check: str) -> list[Finding]:
        """The findings of one check id."""
        return [f for f in self.findings if f.check == check]

    def with_baseline(self, baseline: Report) -> Report:
        """A copy where the findings already in ``baseline`` are accepted: they fail nothing.

        Findings match on :meth:`Finding.key` (check and layer or parameters), never on step
        numbers. Accepted ones get ``details.baselined = True``; ``failed`` is recomputed
        from the others, so only new findings fail the run.

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
            if f.key() in known:
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
        cls = GhostLayerError if any(f.check == "ghost_param" for f in failing) else GradWatchError
        raise cls(f"gradwatch found {len(failing)} problem(s): {lines}")

    def write(self, path: Union[str, Path]) -> Path:
        """Write the JSON report atomically (temp file + rename) and return its path.

        A symlink's target is updated; a path that is not a regular file (a device, a FIFO,
        a folder) is refused. See :func:`gradwatch.report_io.write_text_atomic`.

        Raises:
            ConfigError: ``path`` is not a regular file.
            OSError: the write failed; a previous report at ``path`` is left whole.
        """
        from gradwatch.report_io import write_text_atomic

        return write_text_atomic(path, self.model_dump_json(indent=2), what="JSON report")

    @classmethod
    def read(cls, path: Union[str, Path]) -> Report:
        """Load a report written by :meth:`write`."""
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def summary(self, *, color: bool = False, width: int = 110, style: str = "diagnostic") -> str:
        """The console rendering as text: one block per finding, or ``style="table"``."""
        from gradwatch.render.console import render_text

        return render_text(self, color=color, width=width, style=style)

    def print(self, file: Any = None, *, style: str = "diagnostic") -> None:
        """Print the findings to ``file`` (stdout by default), in colour on a terminal.

        ``style="diagnostic"`` (default) prints one compiler-style block per finding;
        ``style="table"`` a compact table.

        Example:
            >>> report.print(style="table")  # doctest: +SKIP
        """
        from gradwatch.render.console import print_report

        print_report(self, file=file, style=style)

    def to_html(self, path: Union[str, Path]) -> Path:
        """Write a self-contained HTML report with plots (needs ``matplotlib``)."""
        from gradwatch.render.html import write_html

        return write_html(self, Path(path))

    def _repr_html_(self) -> str:
        """Jupyter's rich display: status, findings table and coverage (no charts)."""
        from gradwatch.render.html import notebook_html

        return notebook_html(self)

    def __str__(self) -> str:
        return self.summary()
