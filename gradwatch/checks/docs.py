"""What each check means, for ``gradwatch explain``, SARIF rules and the HTML report.

A check's documentation lives with the check, as its ``doc`` class attribute (a
:class:`CheckDoc`), the way ruff and pylint keep a rule's text next to its code; its default
severity is its config's (``Config``'s ``severity`` default), written nowhere else. This
module holds the type, the lookup, and the text of ids that have no registered check class:
the CLI's ``loss_not_decreasing`` and gradwatch's own ``internal_error`` and
``param_outside_model`` (:data:`DOCS`, each with its severity).

Example:
    >>> lookup("ghost_param").summary
    'A trainable parameter got no gradient between two optimizer steps while others did.'
    >>> default_severity("ghost_param"), default_severity("param_outside_model")
    ('error', 'info')
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["DOCS", "CheckDoc", "all_docs", "default_severity", "explain_text", "lookup"]


@dataclass(frozen=True)
class CheckDoc:
    """The explanation of one check id.

    Attributes:
        summary: one sentence: what fired.
        why: why it matters for training.
        causes: common causes, one per item.
        fix: how to fix it.
        severity: the default severity of an id without a check class (:data:`DOCS`); a
            check's is its ``Config``'s ``severity`` default, so a check's doc leaves it out.
        silence: extra ways to silence it (the generic ones are added by :meth:`silencing`).
    """

    summary: str
    why: str
    causes: tuple[str, ...]
    fix: str
    severity: Optional[str] = None
    silence: tuple[str, ...] = field(default_factory=tuple)

    def silencing(self, check_id: str) -> list[str]:
        """How to silence it: the check's own ways first, then the ones every check has."""
        return [
            *self.silence,
            'Allowlist parameters: `ignore: ["aux_head.*"]` (fnmatch over parameter names) '
            "in the config, or `gradwatch check ... --ignore 'aux_head.*'`.",
            f"Accept it without failing: `checks: {{{check_id}: {{severity: info}}}}` (below "
            f"`fail_on`), or turn it off: `checks: {{{check_id}: {{enabled: false}}}}`.",
            "Accept the findings a project already has in CI: save a report "
            "(`--json baseline.json`) and run `gradwatch check ... --baseline baseline.json`; "
            "only new findings fail.",
        ]


DOCS: dict[str, CheckDoc] = {
    "loss_not_decreasing": CheckDoc(
        summary="`gradwatch check --overfit`: training on one batch did not bring the loss "
        "below 0.9 x its first value.",
        why="A model that cannot overfit a single batch has a bug even when every gradient "
        "looks healthy.",
        causes=(
            "A learning rate of 0, or the wrong parameters in the optimizer.",
            "A loss that ignores the model's output, or labels that do not match the inputs.",
            "Too few `--overfit-steps` for a large model or a tiny learning rate.",
        ),
        fix="Check the optimizer's parameters and learning rate and the loss; raise "
        "`--overfit-steps` if the loss falls slowly.",
        severity="warning",
        silence=("Run `gradwatch check` without `--overfit`.",),
    ),
    "internal_error": CheckDoc(
        summary="A fault inside gradwatch's own hooks, a check or a sink was contained; "
        "training went on without that part.",
        why="The part that failed did not watch the run: its checks may have missed problems.",
        causes=(
            "A gradwatch bug.",
            "A faulty metric sink or an unusual tensor type in a hook.",
        ),
        fix="Report it with `details.traceback`; set `on_internal_error: raise` to get the "
        "full error where it happens.",
        severity="warning",
    ),
    "param_outside_model": CheckDoc(
        summary="An optimizer holds tensors that are not parameters of the watched model; they "
        "are watched under synthesized names.",
        why="Findings about them cannot name the module they belong to.",
        causes=("`watch()` was given a submodule while the optimizer holds the whole model.",),
        fix="Watch the whole model the optimizer trains.",
        severity="info",
    ),
}


def lookup(check_id: str) -> Optional[CheckDoc]:
    """The documentation of ``check_id``: the check class's ``doc``, else :data:`DOCS`."""
    from gradwatch.checks import ALL_CHECKS

    for cls in ALL_CHECKS:
        if cls.id == check_id and cls.doc is not None:
            return cls.doc
    return DOCS.get(check_id)


def default_severity(check_id: str) -> Optional[str]:
    """The default severity of ``check_id``: its check's ``Config`` default, else its DOCS entry's."""
    from gradwatch.checks.registry import by_id

    try:
        return by_id(check_id).default_severity()
    except KeyError:
        doc = DOCS.get(check_id)
        return None if doc is None else doc.severity


def all_docs() -> dict[str, CheckDoc]:
    """Every documented id: the registered checks in their order, then the rest of DOCS."""
    from gradwatch.checks import ALL_CHECKS

    out = {cls.id: cls.doc for cls in ALL_CHECKS if cls.doc is not None}
    for key, doc in DOCS.items():
        out.setdefault(key, doc)
    return out


def _para(text: str, width: int, indent: str = "  ", bullet: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=indent + bullet,
        subsequent_indent=indent + " " * len(bullet),
        break_long_words=False,
        break_on_hyphens=False,
    )


def explain_text(check_id: str, *, width: int = 100) -> Optional[str]:
    """What ``gradwatch explain CHECK`` prints, wrapped to ``width``; ``None`` for an unknown id.

    Example:
        >>> print(explain_text("ghost_param").splitlines()[0])
        ghost_param (default severity: error)
    """
    doc = lookup(check_id)
    if doc is None:
        return None
    width = max(width, 40)
    lines = [f"{check_id} (default severity: {default_severity(check_id)})", ""]
    lines += _para(doc.summary, width, indent="")
    lines += ["", "Why it matters:", *_para(doc.why, width)]
    lines += ["", "Common causes:"]
    for cause in doc.causes:
        lines += _para(cause, width, bullet="- ")
    lines += ["", "How to fix:", *_para(doc.fix, width)]
    lines += ["", "How to silence it:"]
    for way in doc.silencing(check_id):
        lines += _para(way, width, bullet="- ")
    return "\n".join(lines) + "\n"
