"""What each check means, for ``gradwatch explain``, SARIF rules and the HTML report.

A check's documentation lives with the check, as its ``doc`` class attribute (a
:class:`CheckDoc`), the way ruff and pylint keep a rule's text next to its code. This module
holds the type, the lookup, and the text of ids that have no class of their own here: the
CLI's ``loss_not_decreasing``, gradwatch's ``internal_error`` and ``param_outside_model``,
and checks that are specified but may not be implemented yet. A check module added later
can take its text from :data:`DOCS` (``doc = DOCS["double_update"]``) or define its own.

Example:
    >>> lookup("ghost_param").summary
    'A trainable parameter got no gradient between two optimizer steps while others did.'
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["DOCS", "CheckDoc", "all_docs", "explain_text", "lookup"]


@dataclass(frozen=True)
class CheckDoc:
    """The explanation of one check id.

    Attributes:
        summary: one sentence: what fired.
        why: why it matters for training.
        causes: common causes, one per item.
        fix: how to fix it.
        severity: the default severity.
        silence: extra ways to silence it (the generic ones are added by :meth:`silencing`).
    """

    summary: str
    why: str
    causes: tuple[str, ...]
    fix: str
    severity: str = "error"
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
    "loss_disconnected": CheckDoc(
        summary="An optimizer step ran after the model's forward, yet none of its parameters "
        "received a gradient: the loss does not depend on the model.",
        why="Every step is a no-op while the loss may still go down (it is computed from "
        "something else): the run looks alive and learns nothing.",
        causes=(
            "The loss was rebuilt from numbers: `torch.tensor(out.item())`, `.numpy()`, "
            "`.tolist()`.",
            "The output was detached: `out.detach()`, `out.data`.",
            "The forward ran under `torch.no_grad()` / `torch.inference_mode()` (an "
            "evaluation helper reused for training).",
        ),
        fix="Compute the loss from the model's output tensor directly and call `backward()` on "
        "it; keep `no_grad` for evaluation only. `details.cause` says which case it was.",
    ),
    "double_update": CheckDoc(
        summary="One gradient was consumed by more than one optimizer step with no backward in "
        "between.",
        why="The parameter moves twice (or at double the learning rate, with momentum twice "
        "advanced) for one batch: training diverges or behaves unlike the configuration.",
        causes=(
            "A parameter sits in two optimizers that both step (a shared embedding given to a "
            "generator's and a discriminator's optimizer).",
            "`optimizer.step()` called twice for one `backward()` (once in the loop, once in a "
            "helper or callback).",
        ),
        fix="Give every parameter to exactly one optimizer and call `step()` once per "
        "`backward()`; `details.optimizers` lists the optimizers involved.",
    ),
    "unregistered_param": CheckDoc(
        summary="A tensor that requires grad received a gradient through a module that runs in "
        "the forward but is not registered in the model.",
        why="Its parameters are in no `named_parameters()`, no optimizer and no `state_dict`: "
        "they are never trained, never saved, and not moved by `model.to(device)`.",
        causes=(
            "Submodules kept in a plain Python `list`, `dict` or `tuple` attribute "
            "(`self.blocks = [nn.Linear(...) for _ in range(4)]`).",
            "A module created inside `forward` and kept on a non-Module attribute.",
        ),
        fix="Use `nn.ModuleList` / `nn.ModuleDict` (or `nn.ParameterList`) so the modules are "
        "registered; the finding names the attribute path, e.g. `blocks[0].weight`.",
    ),
    "frozen_param_updated": CheckDoc(
        summary="A parameter with `requires_grad=False` changed across an optimizer step.",
        why="A layer meant to be frozen (a pretrained backbone, a teacher) drifts: results "
        "depend on what was supposed to be fixed.",
        causes=(
            "The frozen parameter is still in an optimizer whose weight decay moves it "
            "(`AdamW`, `SGD(weight_decay=...)`).",
            "Momentum or Adam state left from before freezing keeps moving it.",
        ),
        fix="Build the optimizer from trainable parameters only: "
        "`AdamW(p for p in model.parameters() if p.requires_grad)`, or rebuild it after "
        "freezing.",
    ),
    "clipped_while_scaled": CheckDoc(
        summary="Gradients were changed (clipped, normalised, noised) after backward but before "
        "`GradScaler.unscale_`/`scaler.step`, while still multiplied by the loss scale.",
        why="Clipping a scaled gradient clips at `max_norm x scale`: with a scale of 65536 it "
        "never clips, or clips wrongly as the scale changes.",
        causes=(
            "`clip_grad_norm_` called between `scaler.scale(loss).backward()` and "
            "`scaler.step(optimizer)` without `scaler.unscale_(optimizer)` first.",
        ),
        fix="Call `scaler.unscale_(optimizer)` before clipping, as the PyTorch AMP examples do.",
    ),
    "not_observed": CheckDoc(
        summary="The watcher could not see what it promises, so the report cannot be a pass.",
        why="A silent report would read as clean: no step observed, an unreadable parameter "
        "layout or failing hooks mean nothing was checked.",
        causes=(
            "The model ran but no optimizer step or backward pass happened while watching "
            "(the `with` block ended early, a different optimizer object stepped).",
            "Backward passes ran but the watched optimizer never stepped: a forgotten "
            "`optimizer.step()`, or a step that raised before reaching it (`no_step`).",
            "The watched model never ran at all: the loop trained a copy of it, or ran "
            "outside the `with` block (`details.reason: never_ran`).",
            "A parameter layout gradwatch cannot read (flattened FSDP1 parameters without "
            "`use_orig_params=True`).",
            "gradwatch's own hooks failed on every step (see `internal_error`).",
            "Every gradient was written into `.grad` by hand (`torch.func.grad`, "
            "`torch.autograd.grad`) and no `loss.backward()` ran (`no_backward`).",
        ),
        fix="Watch the optimizer that really steps and train inside the `with` block; use "
        "`use_orig_params=True` with FSDP1. `details.reason` says which case it was.",
    ),
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
    lines = [f"{check_id} (default severity: {doc.severity})", ""]
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
