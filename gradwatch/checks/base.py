"""The protocol every check follows: observe what a step exposes, judge facts, emit findings.

A check is one class in one module: its ``id``, its config model (``Config``, whose
``severity`` default is the check's default severity), its documentation (``doc``), the
evidence it needs (``needs``) and the facts it judges (``facts``). The config and
``gradwatch explain`` are built from the registry (:mod:`gradwatch.checks.registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gradwatch._severity import Maturity, Severity
from gradwatch.capture.facts import Fact
from gradwatch.checks.views import RunView, StepView, StructureView
from gradwatch.errors import GradWatchError
from gradwatch.sources.registry import unknown_needs

if TYPE_CHECKING:
    from gradwatch.checks.docs import CheckDoc

__all__ = [
    "STRICT",
    "Check",
    "CheckConfig",
    "FindingLog",
    "WatchSettings",
    "as_preview",
    "severity_field",
]

# Thresholds must be finite (``.inf`` would silently switch a check off); ints and bools are
# strict (``every_n_steps: true`` is a mistake, not 1; ``warn: 1`` is not a boolean). Floats
# accept ints, and the YAML loader reads ``1e-7`` as a number (see ``config/_files.py``).
STRICT = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def severity_field(default: Severity) -> Any:
    """The ``severity`` field of a check's config, defaulting to the check's default severity.

    Example:
        >>> class MissingZeroGradConfig(CheckConfig):
        ...     severity: Severity = severity_field("error")
    """
    return Field(default=default, description="Severity of its findings.")


class CheckConfig(BaseModel):
    """Settings every check has."""

    model_config = STRICT

    enabled: StrictBool = Field(default=True, description="Run this check.")
    severity: Severity = severity_field("warning")


def as_preview(severity: str, details: dict[str, Any], *, preview: bool) -> str:
    """A preview check's finding: ``details`` marked (``maturity: preview``, and the severity
    it has on its own as ``preview_severity``), and the severity it is recorded at: its own
    with ``preview: true`` in the config, else ``info`` (it fails no build and warns nobody).

    Example:
        >>> details = {}
        >>> as_preview("error", details, preview=False), details
        ('info', {'maturity': 'preview', 'preview_severity': 'error'})
    """
    details["maturity"] = "preview"
    details["preview_severity"] = severity
    return severity if preview else "info"


class FindingLog(Protocol):
    """Where checks write findings: one per (check, key or layer), merged as they recur."""

    def emit(
        self,
        check: str,
        *,
        severity: str,
        step: int,
        message: str,
        hint: str = "",
        params: Optional[list[str]] = None,
        module: Optional[str] = None,
        details: Optional[dict[str, Any]] = None,
        key: Optional[str] = None,
    ) -> Any:
        """Record one occurrence (returns the finding, or ``None`` when every name is ignored)."""

    def get(self, check: str, key: str) -> Any:
        """The live finding of ``(check, key)``, if any."""

    def revise(
        self,
        check: str,
        key: str,
        *,
        severity: str,
        message: str,
        hint: str,
        details: dict[str, Any],
    ) -> Any:
        """Rewrite a finding to the latest state without counting an occurrence."""

    def findings(self) -> list[Any]:
        """A copy of every finding so far."""


class WatchSettings(Protocol):
    """The watch-wide settings a check may read (a :class:`gradwatch.GradWatchConfig`)."""

    history: int
    every_n_steps: int


class Check:
    """Base class: a stable ``id``, its config model, its docs, and the callbacks of a run."""

    id: ClassVar[str]
    #: Its settings; the ``severity`` default of this model is the check's default severity
    #: (:meth:`default_severity`), written nowhere else.
    Config: ClassVar[type[CheckConfig]] = CheckConfig
    #: Its lifecycle stage, as ruff's and clippy's rules (SPEC 8.1). ``"stable"``: the clean
    #: corpus (``tests/corpus``) gives it no warning or error, and its findings carry their
    #: severity. ``"preview"``: its findings are ``info`` unless the config sets ``preview:
    #: true``, and say "preview" in every view (:func:`as_preview`, applied once where a
    #: finding is recorded). Every registered check states its own in its class body (the
    #: contract test requires it), so this default is never the decision.
    maturity: ClassVar[Maturity] = "stable"
    #: What ``raise_for_findings`` and ``fail_fast`` raise when this check's findings fail.
    error: ClassVar[type[GradWatchError]] = GradWatchError
    #: What ``gradwatch explain ID`` prints (:mod:`gradwatch.checks.docs` has the fallbacks).
    doc: ClassVar[Optional[CheckDoc]] = None
    #: The kinds of :class:`~gradwatch.capture.facts.Fact` it judges (see :meth:`on_fact`).
    facts: ClassVar[frozenset[str]] = frozenset()
    #: Evidence it needs beyond every step's gradients: names served by the evidence
    #: sources (``gradwatch.sources.registry.NEEDS``; each source's module docstring says
    #: what its names give). The run builds only the sources an enabled check names; a
    #: name no source serves is a ``TypeError`` when the class is defined.
    needs: ClassVar[frozenset[str]] = frozenset()
    #: Whether the layers of its findings keep their forward hooks once the others are
    #: trimmed (``trim_hooks_after``): a ghost's cause comes from them.
    keeps_forward_hooks: ClassVar[bool] = False
    #: Whether its findings (warning or error) name parts of the model that do not train
    #: (``ghost_param``, ``stale_param``, ``not_in_optimizer``): when such findings together
    #: hold most (more than half) of the model's trainable elements, each of them is an
    #: error whatever its own severity (see ``FindingLog.escalate``). Such findings carry
    #: ``details.numel``, the element count of their parameters.
    counts_toward_share: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown_needs(cls.needs, f"check {cls.__name__}")

    @classmethod
    def default_severity(cls) -> str:
        """The severity of its findings unless a config says otherwise (its Config's default)."""
        default = cls.Config.model_fields["severity"].default
        assert isinstance(default, str)
        return default

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        self.config = config
        self.watch_config = watch_config

    @property
    def severity(self) -> str:
        return self.config.severity

    def evidence(self) -> dict[str, Any]:
        """The evidence it needs, each with its setting (e.g. how many steps to scan for)."""
        return dict.fromkeys(self.needs, True)

    @classmethod
    def call_site(cls, finding: Any) -> Optional[str]:
        """The module whose calling line ``finding`` should name (``details.called_at``)."""
        return None

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        """Called when the parameter/optimizer layout is first seen or changes."""

    def on_step(self, view: StepView, log: FindingLog) -> None:
        """Called once per optimizer step (per backward pass without an optimizer)."""

    def on_run(self, view: RunView, log: FindingLog) -> None:
        """Called once when the watcher closes, with what the whole run showed."""

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        """Judge one fact the run recorded (a kind in :attr:`facts`): by default, one
        finding per ``fact.key`` at this check's severity."""
        log.emit(
            self.id,
            severity=self.severity,
            step=fact.step,
            message=fact.message,
            hint=fact.hint,
            params=fact.params,
            key=fact.key,
            details=fact.details,
        )
