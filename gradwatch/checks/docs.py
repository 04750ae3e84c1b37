"""What each check means, for ``gradwatch explain``, SARIF rules and the HTML report.

A check's documentation lives with the check, as its ``doc`` class attribute (a
:class:`CheckDoc`), the way ruff and pylint keep a rule's text next to its code; its default
severity is its config's (``Config``'s ``severity`` default), written nowhere else. This
module holds the type and the text of ids that have no check class: the CLI's
``loss_not_decreasing`` (:data:`DOCS`, with its severity). The lookup and ``explain`` text,
which need the registry, are in :mod:`gradwatch.checks.explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["DOCS", "CheckDoc"]


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
        detail: the full account, for the check's documentation page ("In detail: ..."): what
            exactly fires it, the designs that are fine, what is not judged, the ``details``
            keys. Written here once; the docs site's checks pages are generated from it.
    """

    summary: str
    why: str
    causes: tuple[str, ...]
    fix: str
    severity: Optional[str] = None
    silence: tuple[str, ...] = field(default_factory=tuple)
    detail: str = ""

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
}
