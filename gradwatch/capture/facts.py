"""Facts: what the run saw once (a fault, a layout it cannot read), for a check to judge.

The lower layers never emit findings: they record a :class:`Fact` through the ``report``
callable the run gives them, and the check that declares the fact's ``kind`` in its
``facts`` judges it (``gradwatch.checks.base.Check.on_fact``).

Example:
    >>> Fact("unobservable", step=0, key="no_step", message="No optimizer step ran.").kind
    'unobservable'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = [
    "EVAL_STOCHASTIC",
    "FAULT",
    "FED_EVAL",
    "FOREIGN_TENSORS",
    "REPLICAS_DIFFER",
    "RESUMED",
    "SKIPPED_STEPS",
    "UNOBSERVABLE",
    "Fact",
    "Report",
]

UNOBSERVABLE = "unobservable"
"""gradwatch could not see something it promises (``details.reason`` says what)."""
FAULT = "fault"
"""One of gradwatch's own places failed; training went on without it."""
FOREIGN_TENSORS = "foreign_tensors"
"""An optimizer holds tensors that are not parameters of the watched model."""
SKIPPED_STEPS = "skipped_steps"
"""A GradScaler skipped optimizer steps for inf/NaN gradients (``details``: ``skipped``,
``total``, and the NaN probe's ``trace`` when it had one)."""

EVAL_STOCHASTIC = "eval_stochastic"
"""A dropout ran as in training inside an eval-mode forward (``details``: ``module``,
``function``, ``p``, ``called_at``)."""
FED_EVAL = "fed_eval"
"""An eval-mode forward's batch, against the samples trained on (``details``: ``samples``,
``trained``, ``last_batch``: all its samples are the last train batch's, ``module``)."""
REPLICAS_DIFFER = "replicas_differ"
"""Parameters that data-parallel replicas must hold identical differ across ranks
(``details``: ``ranks``, ``first_step``)."""
RESUMED = "resumed"
"""A resumed run does not continue what its checkpoint saved (``details.aspect``: params,
optimizer, lr, scheduler, step)."""


@dataclass
class Fact:
    """One thing the run saw: its kind, when, the key it is told apart by, and what it was."""

    kind: str
    step: int
    key: str
    message: str
    hint: str = ""
    params: Optional[list[str]] = None
    details: dict[str, Any] = field(default_factory=dict)


Report = Callable[[Fact], None]
"""What a lower layer is given to record a fact with."""
