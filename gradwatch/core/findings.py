"""Collects findings (one per check and layer, warnings once, allowlist) and routes to the checks.

:class:`Judges` hands each view and fact to the checks that judge it, each call guarded;
:class:`FindingLog` is where they write. The run never writes a finding itself.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from gradwatch._text import safe
from gradwatch.capture.facts import Fact
from gradwatch.checks import Check, RunView, StepView, StructureView
from gradwatch.checks.registry import by_id, error_class
from gradwatch.config import GradWatchConfig
from gradwatch.errors import GradWatchWarning
from gradwatch.model.locations import Locations
from gradwatch.results import Finding

_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the gradwatch package
    os.path.dirname(torch.__file__),
)
_LIGHTNING = ("pytorch_lightning", "lightning")


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside gradwatch, torch and Lightning.

    The user's line (``optimizer.step()``, ``loss.backward()``, ``trainer.fit()``) is where
    a warning should point. Lightning is skipped only if the user already imported it.
    """
    files = [getattr(sys.modules.get(name), "__file__", None) for name in _LIGHTNING]
    internal = _INTERNAL + tuple(os.path.dirname(f) for f in files if isinstance(f, str))
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _warn(text: str, stacklevel: int) -> None:
    """One ``GradWatchWarning`` that never aborts the user's step.

    This runs inside ``optimizer.step()`` and ``loss.backward()`` hooks. A filter that turns
    warnings into errors (``python -W error``, pytest's ``filterwarnings = error``) would raise
    out of them and stop training, which only ``fail_fast`` may do. The warning it refused is
    shown instead (``warnings.showwarning``: stderr, or pytest's warnings summary); the
    finding is in the report, which fails the run as usual.
    """
    try:
        warnings.warn(text, GradWatchWarning, stacklevel=stacklevel)
    except Exception:
        try:
            frame = sys._getframe(stacklevel - 1)
            where, line = frame.f_code.co_filename, frame.f_lineno
        except ValueError:
            where, line = "gradwatch", 0
        warnings.showwarning(GradWatchWarning(text), GradWatchWarning, where, line)


class FindingLog:
    """The running set of findings of one watcher."""

    def __init__(self, config: GradWatchConfig) -> None:
        self.config = config
        self._findings: dict[tuple[str, str], Finding] = {}
        self._warned: set[tuple[str, str]] = set()
        self._fail_fast: list[Finding] = []
        self.emit_warnings = config.warn
        self._ignored: dict[str, bool] = {}
        self.revision = 0  # bumped when a finding appears or changes severity
        self.quiet_checks: set[str] = set()  # e.g. set on non-zero ranks for rank-0-only findings
        self.locations: Optional[Locations] = None  # source lines of flagged layers

    def ignored(self, name: str) -> bool:
        if not self.config.ignore:
            return False
        hit = self._ignored.get(name)
        if hit is None:
            hit = self._ignored[name] = any(
                fnmatch.fnmatchcase(name, pat) for pat in self.config.ignore
            )
        return hit

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
    ) -> Optional[Finding]:
        """Record one occurrence; merge into the finding of the same (check, key/layer)."""
        names = [n for n in params if not self.ignored(n)] if params else []
        if params and not names:
            return None
        ident = (check, key or module or (names[0] if names else ""))
        finding = self._findings.get(ident)
        if finding is None:
            finding = Finding(
                check=check,
                severity=severity,  # type: ignore[arg-type]
                message=message,
                hint=hint,
                params=names,
                module=module,
                first_step=step,
                last_step=step,
                count=1,
                details=dict(details or {}),
            )
            self._findings[ident] = finding
            self.revision += 1
        else:
            # A finding is updated at every step it recurs (per layer: hundreds per step on a
            # sick model); pydantic's validating __setattr__ would cost more than the check.
            # The values are already valid, so write the fields directly.
            fields = finding.__dict__
            fields["last_step"] = max(finding.last_step, step)
            fields["count"] = finding.count + 1
            fields["message"] = message
            if severity != finding.severity:
                fields["severity"] = severity
                self.revision += 1
            if hint:
                fields["hint"] = hint  # the latest state's advice (an intermittent ghost's)
            if module is not None and key is not None and module != finding.module:
                fields["module"] = module  # keyed findings may learn a better module later
                self.revision += 1
            if names != finding.params:
                finding.params.extend(n for n in names if n not in finding.params)
            if details:
                finding.details.update(details)
        if self.locations is not None:
            self.locations.annotate(finding)
        self._surface(finding, names or [ident[1] or finding.check])
        return finding

    def __len__(self) -> int:
        """How many findings there are so far."""
        return len(self._findings)

    def get(self, check: str, key: str) -> Optional[Finding]:
        """The live finding of ``(check, key)`` (its layer, or the key it was emitted with)."""
        return self._findings.get((check, key))

    def keyed(self) -> list[tuple[tuple[str, str], Finding]]:
        """Every live finding with its ``(check, key)``, in the order :meth:`findings` lists."""
        return list(self._findings.items())

    def warned_about(self) -> list[tuple[str, str]]:
        """The ``(check, parameter)`` pairs already warned about, sorted."""
        return sorted(self._warned)

    def restore(
        self, keyed: list[tuple[tuple[str, str], Finding]], warned: list[tuple[str, str]]
    ) -> None:
        """Put findings and warnings of an earlier run back (a resumed checkpoint).

        The same problem seen again merges into its restored finding (``count`` keeps
        growing) and is not warned about twice. A finding already live is kept.
        """
        for ident, finding in keyed:
            self._findings.setdefault(ident, finding)
        self._warned.update(warned)
        self.revision += 1

    def revise(
        self,
        check: str,
        key: str,
        *,
        severity: str,
        message: str,
        hint: str,
        details: dict[str, Any],
    ) -> Optional[Finding]:
        """Rewrite a finding to the latest state without counting an occurrence.

        A ghost that later receives a gradient is intermittent: its severity, message, hint
        and details change, its count and steps do not. A warning already emitted stays.
        """
        finding = self._findings.get((check, key))
        if finding is None:
            return None
        fields = finding.__dict__
        if severity != finding.severity:
            fields["severity"] = severity
            self.revision += 1
        fields["message"] = message
        fields["hint"] = hint
        finding.details.update(details)
        self._surface(finding, finding.params or [key])
        return finding

    def _surface(self, finding: Finding, names: list[str]) -> None:
        if finding.severity == "info":
            return  # marked only once it warns: an info finding raised later still warns
        fresh = [n for n in names if (finding.check, n) not in self._warned]
        if not fresh:
            return
        self._warned.update((finding.check, n) for n in fresh)
        if finding.severity == "error" and self.config.fail_fast:
            self._fail_fast.append(finding)
        if self.emit_warnings and finding.check not in self.quiet_checks:
            level = _user_stacklevel()
            where = finding.details.get("defined_at")
            for name in fresh:
                _warn(
                    safe(
                        f"gradwatch {finding.check} [{name}]: {finding.message}"
                        + (f" Hint: {finding.hint}" if finding.hint else "")
                        + (f" (defined at {where})" if where else "")
                    ),
                    level + 1,
                )

    def raise_fail_fast(self) -> None:
        """With ``fail_fast``, raise for the error-level findings that appeared in this step."""
        if not self._fail_fast:
            return
        found, self._fail_fast = self._fail_fast, []
        text = "; ".join(f"{f.line()} [{safe(', '.join(f.params[:8]))}]" for f in found)
        cls = error_class(f.check for f in found)
        raise cls(f"gradwatch (fail_fast): {text}")

    def findings(self) -> list[Finding]:
        """A copy of every finding so far."""
        if self.locations is not None:  # a call site captured since the finding's last step
            for finding in self._findings.values():
                self.locations.annotate(finding)
        return [f.model_copy(deep=True) for f in self._findings.values()]


Guard = Callable[..., Any]


class Judges:
    """The checks of one watcher: each view or fact goes to the checks that judge it.

    Every call is guarded (``guard(where, fn, *args)``, :class:`~gradwatch.core.faults.Faults`):
    a failing check is an ``internal_error``, never a crashed step.
    """

    def __init__(self, checks: list[Check], log: FindingLog, guard: Guard) -> None:
        self.checks = checks
        self.log = log
        self._guard = guard
        self._by_fact: dict[str, list[Check]] = {}
        for check in checks:
            for kind in check.facts:
                self._by_fact.setdefault(kind, []).append(check)
        self._keep_hooks = {c.id for c in checks if c.keeps_forward_hooks}

    def structure(self, view: StructureView) -> None:
        """The layout was first seen or changed."""
        for check in self.checks:
            self._guard(f"{check.id} check", check.on_structure, view, self.log)

    def step(self, view: StepView) -> None:
        """One step's view (an optimizer step, or a backward pass without an optimizer)."""
        for check in self.checks:
            self._guard(f"{check.id} check", check.on_step, view, self.log)

    def run(self, view: RunView) -> None:
        """The whole run, once, when the watcher closes."""
        for check in self.checks:
            self._guard(f"{check.id} check", check.on_run, view, self.log)

    def fact(self, fact: Fact) -> None:
        """A fact the run recorded: the checks that declared its kind judge it."""
        for check in self._by_fact.get(fact.kind, ()):
            self._guard(f"{check.id} check", check.on_fact, fact, self.log)

    def evidence(self) -> dict[str, Any]:
        """What the enabled checks need gathered, each with the largest setting asked for."""
        out: dict[str, Any] = {}
        for check in self.checks:
            for name, value in check.evidence().items():
                old = out.get(name)
                out[name] = value if old is None or old is True else max(old, value)
        return out

    def needing(self, evidence: str) -> list[str]:
        """The ids of the checks that need ``evidence``."""
        return [c.id for c in self.checks if evidence in c.needs]

    def hooked_modules(self, findings: Iterable[Any]) -> set[str]:
        """Layers of findings whose check keeps their forward hooks on once trimmed."""
        return {f.module for f in findings if f.check in self._keep_hooks and f.module}


def call_site(finding: Any) -> Optional[str]:
    """The module whose calling line ``finding`` wants, as its check says (``None``: none)."""
    try:
        cls = by_id(finding.check)
    except KeyError:
        return None
    return cls.call_site(finding)
