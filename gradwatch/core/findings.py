"""Collects findings (one per check and layer, warnings once, allowlist) and routes to the checks.

:class:`Judges` hands each view and fact to the checks that judge it, each call guarded;
:class:`FindingLog` is where they write. The run never writes a finding itself.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any, Callable, Optional

from gradwatch._text import safe
from gradwatch._warnings import warn_at_user, warning_text
from gradwatch.capture.facts import Fact
from gradwatch.checks import Check, RunView, StepView, StructureView
from gradwatch.checks.base import as_preview
from gradwatch.checks.registry import by_id, error_class, preview_ids
from gradwatch.config import GradWatchConfig
from gradwatch.model.locations import Locations
from gradwatch.results import Finding


class FindingLog:
    """The running set of findings of one watcher."""

    def __init__(self, config: GradWatchConfig) -> None:
        self.config = config
        self._findings: dict[tuple[str, str], Finding] = {}
        self._warned: set[tuple[str, str]] = set()  # (check, key) of findings warned about
        self._raised: set[tuple[str, str]] = set()  # ... queued for fail_fast
        self._escalated_at = -1  # the revision ``escalate`` last judged
        self._fail_fast: list[Finding] = []
        self.emit_warnings = config.warn
        self._ignored: dict[str, bool] = {}
        self.revision = 0  # bumped when a finding appears or changes severity
        self.quiet_checks: set[str] = set()  # e.g. set on non-zero ranks for rank-0-only findings
        self.locations: Optional[Locations] = None  # source lines of flagged layers
        # Checks in preview: their findings are info unless ``preview: true`` (SPEC 8.1),
        # applied here, where every finding of the run is recorded, and nowhere else.
        self._preview = preview_ids()

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
        if check in self._preview:
            details = dict(details or {})
            severity = as_preview(severity, details, preview=self.config.preview)
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
            fields["message"] = message + _share_note(finding)
            severity = _kept(finding, severity)
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
        self._surface(finding, ident)
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
        """The ``(check, key)`` of the findings already warned about, sorted."""
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
        if check in self._preview:
            details = dict(details)
            severity = as_preview(severity, details, preview=self.config.preview)
        fields = finding.__dict__
        severity = _kept(finding, severity)
        if severity != finding.severity:
            fields["severity"] = severity
            self.revision += 1
        fields["message"] = message + _share_note(finding)
        fields["hint"] = hint
        finding.details.update(details)
        self._surface(finding, (check, key))
        return finding

    def escalate(self, checks: set[str], total: Callable[[], int]) -> None:
        """Severity follows the share of the model: when the warning/error findings of
        ``checks`` (ghosts, stale layers, parameters in no optimizer) together hold more than
        half of the model's ``total()`` trainable elements (their ``details.numel``), each
        is an error, whatever its check's default: lr 0 everywhere, or 95 % of the model in
        no optimizer, fails ``fail_on=error``. Sticky while the check reports it at
        warning; an ``info`` state (a ghost that trains now) lowers it. Judged when a
        finding appeared or changed."""
        if not checks or self.revision == self._escalated_at:
            return
        self._escalated_at = self.revision
        live = [
            (ident, f)
            for ident, f in self._findings.items()
            if ident[0] in checks and f.severity != "info"
        ]
        flagged = sum(int(f.details.get("numel") or 0) for _, f in live)
        if not flagged:
            return
        n = total()
        if n <= 0 or 2 * flagged <= n:
            return
        share = round(min(flagged / n, 1.0), 4)
        for ident, f in live:
            fields = f.__dict__
            fresh = "model_share" not in f.details
            f.details["model_share"] = share
            if fresh:
                fields["message"] = f.message + _share_note(f)
            if f.severity != "error":
                fields["severity"] = "error"
                self.revision += 1
                self._surface(f, ident)
        self._escalated_at = self.revision

    def _surface(self, finding: Finding, ident: tuple[str, str]) -> None:
        """One warning per finding (the first time it is a warning or an error), whatever
        how many parameters it names; with ``fail_fast``, queue it the first time it is an
        error (a warning raised to an error later fails fast too)."""
        if finding.severity == "info":
            return  # marked only once it warns: an info finding raised later still warns
        if finding.severity == "error" and self.config.fail_fast and ident not in self._raised:
            self._raised.add(ident)
            self._fail_fast.append(finding)
        if ident in self._warned:
            return
        self._warned.add(ident)
        if self.emit_warnings and finding.check not in self.quiet_checks:
            warn_at_user(warning_text(finding, ident[1]))

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


def _share_note(finding: Finding) -> str:
    """The message's note on a finding raised to an error by the share of the model."""
    share = finding.details.get("model_share")
    if not isinstance(share, (int, float)):
        return ""
    return (
        f" Most of the model ({int(share * 100)}% of its trainable elements) does not train: "
        "an error whatever the check's default."
    )


def _kept(finding: Finding, severity: str) -> str:
    """An error by the share of the model stays one while its check still reports it."""
    if severity == "warning" and "model_share" in finding.details:
        return "error"
    return severity


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
        self._share = {c.id for c in checks if c.counts_toward_share}
        # The checks that judge steps, with their labels: a step calls only those (hot path).
        # (The method is looked up at each call: a check patched after attaching is called.)
        self._on_step = [
            (f"{c.id} check", c) for c in checks if type(c).on_step is not Check.on_step
        ]

    def structure(self, view: StructureView) -> None:
        """The layout was first seen or changed."""
        for check in self.checks:
            self._guard(f"{check.id} check", check.on_structure, view, self.log)
        self._escalate(view.index)

    def step(self, view: StepView) -> None:
        """One step's view (an optimizer step, or a backward pass without an optimizer)."""
        guard, log = self._guard, self.log
        for where, check in self._on_step:
            guard(where, check.on_step, view, log)
        self._escalate(view.index)

    def _escalate(self, index: Any) -> None:
        """Severity by the share of the model (:meth:`FindingLog.escalate`)."""
        self._guard("severity by share", self.log.escalate, self._share, lambda: _trainable(index))

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
        """Layers of findings whose check keeps their forward hooks on once trimmed (every
        layer of a grouped finding: ``details.layers``)."""
        out: set[str] = set()
        for f in findings:
            if f.check in self._keep_hooks:
                out.update(f.details.get("layers") or ())
                if f.module:
                    out.add(f.module)
        return out


def call_site(finding: Any) -> Optional[str]:
    """The module whose calling line ``finding`` wants, as its check says (``None``: none)."""
    try:
        cls = by_id(finding.check)
    except KeyError:
        return None
    return cls.call_site(finding)


def _trainable(index: Any) -> int:
    """Elements of the model's live trainable parameters (not tensors outside the model)."""
    total = 0
    for info in index.params:
        p = info.ref()
        if p is not None and p.requires_grad and not info.outside_model:
            total += info.numel
    return total
