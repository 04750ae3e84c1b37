"""The records a report is made of: findings, layer rows, coverage, curvature, and the run's data.

:class:`ReportData` holds every field of a :class:`~gradwatch.Report`; the report adds the
methods that render and write it (:mod:`gradwatch.report`). The renderers read these
records and never import the report, so the dependency runs one way.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticSerializationError

from gradwatch._severity import FailOn, Severity, at_least
from gradwatch._text import safe
from gradwatch.checks.not_observed import ALL_IGNORED, NotObserved
from gradwatch.config import GradWatchConfig

__all__ = [
    "SCHEMA_VERSION",
    "Coverage",
    "Curvature",
    "Finding",
    "LayerCurvature",
    "LayerStats",
    "ProbeLayer",
    "ProbeResult",
    "ReportData",
]


SCHEMA_VERSION = 1


# NaN/Inf norms are data here (a NaN gradient is what the report is about), but the NaN and
# Infinity literals are not JSON (jq, JSON.parse and Go reject them): they are written as the
# strings "NaN", "Infinity" and "-Infinity". Reports written with the literals still load.
_JSON = ConfigDict(ser_json_inf_nan="strings")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# A lone surrogate (a name decoded with os.fsdecode from bytes that are not UTF-8) cannot be
# encoded as UTF-8 nor read back from a JSON escape: such names are written as "\\udcff" text.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _from_json(value: Any) -> Any:
    """``details`` read from JSON: the strings a non-finite float was written as are floats."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _no_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in a string (keys too) shown as ``\\uXXXX`` text."""
    if isinstance(value, str):
        return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    if isinstance(value, (list, tuple)):
        return type(value)(_no_surrogates(v) for v in value)
    if isinstance(value, dict):
        return {_no_surrogates(k): _no_surrogates(v) for k, v in value.items()}
    return value


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

    @field_validator("details", mode="before")
    @classmethod
    def _nonfinite_details(cls, value: Any, info: ValidationInfo) -> Any:
        return _from_json(value) if info.mode == "json" else value

    def cause(self) -> str:
        """The short "why" of the finding: ``details.cause``, else ``details.origin``, else ""."""
        for key in ("cause", "origin"):
            value = self.details.get(key)
            if value:
                return str(value)
        return ""

    def preview(self) -> bool:
        """Whether its check is in preview (``details.maturity``): ``info`` unless the config
        sets ``preview: true`` (``details.preview_severity`` is the severity it has then)."""
        return self.details.get("maturity") == "preview"

    def severity_label(self) -> str:
        """Its severity as every view shows it: ``info (preview)`` for a preview check's."""
        return f"{self.severity} (preview)" if self.preview() else self.severity

    def line(self) -> str:
        """A one-line rendering: ``[severity] check module: message`` (control bytes escaped)."""
        where = f" {self.module}" if self.module else ""
        return safe(f"[{self.severity_label()}] {self.check}{where}: {self.message}")

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


class ProbeLayer(BaseModel):
    """One layer's derivative agreement in the ``gradient_mismatch`` probe."""

    model_config = _JSON

    name: str
    params: list[str] = Field(default_factory=list)
    autograd: float = Field(description="Autograd's directional derivative along v.")
    numeric: float = Field(description="The central finite difference along v.")
    error: float = 0.0
    status: str = Field(default="agree", description="agree, mismatch, explained or inconclusive.")


class ProbeResult(BaseModel):
    """One probe that ran on a copy of the model: its verdict, its cost, what it saw."""

    model_config = _JSON

    id: str
    verdict: str = Field(description="passed, finding, or not_observed (it could not judge).")
    seconds: float = 0.0
    memory_bytes: int = Field(default=0, description="Bytes of the copy it worked on.")
    sampled: bool = Field(default=False, description="It sampled layers to stay in budget.")
    note: str = ""
    curve: list[float] = Field(default_factory=list, description="The overfit probe's losses.")
    layers: list[ProbeLayer] = Field(default_factory=list)
    details: dict[str, Any] = Field(default_factory=dict)


class ReportData(BaseModel):
    """Every field of a :class:`~gradwatch.Report`: the run's counts, findings, layers, coverage."""

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
    probes: list[ProbeResult] = Field(default_factory=list)

    def model_dump_json(self, **kwargs: Any) -> str:  # type: ignore[override]
        """Strict JSON (no NaN/Infinity literals), whatever the names hold (lone surrogates)."""
        try:
            return super().model_dump_json(**kwargs)
        except PydanticSerializationError:
            pass  # a lone surrogate somewhere: written as text, below (raises if it was not)
        clean = type(self).model_validate(_no_surrogates(self.model_dump()))
        return BaseModel.model_dump_json(clean, **kwargs)

    def schema_problem(self) -> Optional[str]:
        """Why this data is no report this gradwatch wrote (``None`` when it is one).

        Every field has a default, so a file of another schema, or one without its
        ``findings`` list, would otherwise read as a clean, passing report.
        """
        if self.schema_version != SCHEMA_VERSION:
            return (
                f"schema_version {self.schema_version} is not the one this gradwatch reads "
                f"({SCHEMA_VERSION}): write it with this version"
            )
        if "findings" not in self.model_fields_set:
            return "it has no 'findings' list"
        return None

    def verdict(self) -> str:
        """``FAILED``, ``passed``, or ``NOT JUDGED`` when ``ignore`` matched every parameter."""
        if self.failed:
            return "FAILED"
        for f in self.findings:
            if f.check == NotObserved.id and f.details.get("reason") == ALL_IGNORED:
                return f"NOT JUDGED ({f.details.get('ignored', 'all')} parameters ignored)"
        return "passed"

    def failing(self) -> list[Finding]:
        """The findings at or above ``fail_on`` (except those a baseline accepted)."""
        return [
            f for f in self.findings if at_least(f.severity, self.fail_on) and not f.baselined()
        ]

    def by_check(self, check: str) -> list[Finding]:
        """The findings of one check id."""
        return [f for f in self.findings if f.check == check]
