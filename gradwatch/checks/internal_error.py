"""``internal_error``: one of gradwatch's own places failed, and training went on without it.

Always on and not configurable: a fault inside gradwatch must be seen, never hidden. The
run's fault containment (``core/faults.py``) records each failing place once as a
:data:`~gradwatch.capture.facts.FAULT` fact; this check turns it into the finding.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.capture.facts import FAULT
from gradwatch.checks.base import Check, CheckConfig
from gradwatch.checks.docs import CheckDoc

__all__ = ["InternalError"]


class InternalErrorConfig(CheckConfig):
    """``internal_error`` (not part of the user's config: always on)."""

    severity: Severity = Field(default="warning", description="Severity of its findings.")


class InternalError(Check):
    """A fault in gradwatch's own hooks, contained: a finding per failing place."""

    id = "internal_error"
    maturity = "stable"
    Config = InternalErrorConfig
    facts = frozenset({FAULT})
    doc = CheckDoc(
        summary="A fault inside gradwatch's own hooks, a check or a sink was contained; "
        "training went on without that part.",
        why="The part that failed did not watch the run: its checks may have missed problems.",
        causes=(
            "A gradwatch bug.",
            "A faulty metric sink or an unusual tensor type in a hook.",
        ),
        fix="Report it with `details.traceback`; set `on_internal_error: raise` to get the "
        "full error where it happens.",
    )
