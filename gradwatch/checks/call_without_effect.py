"""``call_without_effect``: a state change the user asked for did not hold at the next step.

A property of every correct program: what the user asks of the model and the optimizer
takes effect by the next step. The evidence (``state_calls``,
:mod:`gradwatch.sources.state_calls`) compares each intent with the state at the step:

- ``load_state_dict(strict=False)`` whose missing keys are trainable parameters that the
  state dict holds under another name (a ``module.``, ``model.`` or ``_orig_mod.`` prefix,
  the same shape), or that loaded nothing: the weights stay at their initialisation;
- a hyperparameter written where ``step()`` never reads it: ``opt.lr = ...`` on a torch
  optimizer, ``opt.defaults["lr"] = ...`` after construction, a scheduler (or a hand-written
  loop over ``param_groups``) driving another optimizer object over the same parameters that
  is never stepped (an optimizer built again after its scheduler);
- ``sub.eval()`` or ``sub.requires_grad_(False)`` below the root, undone by an ancestor's
  ``train()`` / ``requires_grad_(True)`` before the step;
- a dtype or device asked of a module below the root (``sub.float()``, ``.half()``,
  ``.double()``, ``.bfloat16()``, ``.cuda()``, ``.cpu()``, ``.to(dtype or device)``),
  undone by an ancestor's blanket move before the step: ``model.head.float()`` to keep the
  head in fp32, then ``model.half()`` or ``model.to(torch.bfloat16)``.

A ``strict=False`` load made before ``watch()`` began is judged too, at the first step: from
``import gradwatch`` on, ``nn.Module.load_state_dict`` is wrapped transparently and such
loads are kept (weak references and key names, no tensors; :mod:`gradwatch._loads`;
``GRADWATCH_RECORD_LOADS=0`` turns it off).

Instances of the same property with their own ids stay theirs: ``freeze_not_applied``
(``module.requires_grad = False``), ``frozen_stats_updated`` (a frozen norm layer put back
in train mode), ``scheduler_misstepped``, ``clip_without_effect``, ``tie_broken``.

Correct and silent: a new head left missing by a ``strict=False`` fine-tuning load,
``model.eval()`` for validation then ``model.train()``, gradual unfreezing after some steps,
unfreezing a few parameters of a frozen block by hand, a scheduler on the stepped optimizer,
a custom optimizer that reads its own attributes, ``model.half()`` then
``model.norm.float()`` (the exceptions after the blanket cast), a module cast and run before
the whole model is cast, a move of the whole model, a module moved back by its own call, a
blanket move that leaves the module as asked (``model.to(device)`` after ``head.float()``).

Not judged: an ``eval()``, freeze or move asked before ``watch()`` began (those calls are
followed while watching; only loads are kept from import), loads that left
only buffers missing, moves by ``type()``, ``xpu()`` and other ``_apply`` users, a
scheduler's value overwritten by hand on the stepped optimizer (a manual warm-up is a
design), writes to hyperparameters a custom optimizer keeps elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch._severity import Severity
from gradwatch.checks._params import under
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView
from gradwatch.model.index import ROOT

if TYPE_CHECKING:
    from gradwatch.capture.loop.lr_writes import IgnoredWrite
    from gradwatch.capture.loop.state_calls import Intent, Misload
    from gradwatch.checks.base import FindingLog


class CallWithoutEffectConfig(CheckConfig):
    """``call_without_effect``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


_UNDONE = {  # kind: (the call asked, the call that undid it, the state at the step)
    "eval": ("eval()", "train()", " trains in train mode at the step"),
    "freeze": ("requires_grad_(False)", "requires_grad_(True)", " trains at the step"),
}


def _at(site: Any) -> str:
    return f" at {site}" if site else ""


class CallWithoutEffect(Check):
    """Per step: each state change asked for since the previous step that the step's state
    does not show, by the line that asked."""

    id = "call_without_effect"
    maturity = "stable"
    Config = CallWithoutEffectConfig
    needs = frozenset({"state_calls"})
    doc = CheckDoc(
        summary="A state change the user asked for did not take effect by the next step: a "
        "`strict=False` load that missed trained weights, a learning rate written where "
        "`step()` does not read it, a freeze, `eval()` or dtype/device move undone before "
        "the step.",
        why="The run trains as if the call had not been made, while the code says it was: "
        "a pretrained model trains from scratch, a schedule never reaches the optimizer, a "
        "frozen encoder trains. Nothing fails.",
        causes=(
            "A checkpoint saved from `DataParallel` (`module.` prefix), a Lightning module "
            "(`model.`) or `torch.compile` (`_orig_mod.`) loaded with `strict=False`.",
            "An optimizer built again after its LR scheduler, so the scheduler drives the "
            "old one; `opt.lr = x` or `opt.defaults['lr'] = x` instead of the param groups.",
            "`model.encoder.eval()` / `.requires_grad_(False)` before the loop, undone by "
            "`model.train()` / `model.requires_grad_(True)` at the epoch's start.",
            "`model.norm.float()` to keep a norm layer or head in fp32, then `model.half()` / "
            "`model.to(torch.bfloat16)`, which casts it back.",
        ),
        fix="Strip or add the prefix before loading (and check the returned missing keys); "
        "write `for g in opt.param_groups: g['lr'] = x` on the optimizer that steps, and "
        "build schedulers after the optimizer they drive; re-apply a partial freeze, eval or "
        "cast after the blanket call (or override `train()`).",
        detail="a state change asked for did not hold at the next step: "
        "`load_state_dict(strict=False)` whose missing trainable weights the state dict holds "
        "under another prefix (`module.`, `model.`, `_orig_mod.`, the same shape) or that loaded "
        "nothing, made while watching or before `watch()` began (judged at the first step); a "
        "hyperparameter written where `step()` does not read it (`opt.lr = x` on a torch "
        "optimizer, `opt.defaults['lr'] = x` after construction, a scheduler or a loop over "
        "`param_groups` on another optimizer object over the same parameters that never steps); "
        "`sub.eval()`, `sub.requires_grad_(False)` or a dtype/device move of `sub` (`float()`, "
        "`half()`, `double()`, `bfloat16()`, `cuda()`, `cpu()`, `to(...)`) undone by an "
        "ancestor's blanket call before the step, before `sub` ran a forward in that state. "
        "`nn.Module.load_state_dict` is wrapped from `import gradwatch` on (transparently; "
        "`GRADWATCH_RECORD_LOADS=0` turns it off), `train`, `requires_grad_` and the moves while "
        "watching (restored on exit); `details.kind` (`load_state_dict`, `eval`, `freeze`, "
        "`dtype`, `device`, or where a hyperparameter went), `details.called_at`. A new head "
        "missing from a fine-tuning load, validation's `eval()`/`train()`, gradual unfreezing "
        "after steps, a partial unfreeze by hand, a scheduler on the stepped optimizer, "
        "`model.half()` then `model.norm.float()`, a module cast and used before the blanket "
        "cast are fine. Not judged: an eval, freeze or move asked before `watch()` began, "
        "moves through `type()`/`xpu()`, a scheduler's value overwritten by hand on the "
        "stepped optimizer",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = view.window.records.get("state_calls")
        if rec is None:
            return
        for m in rec.misloads:
            self._misload(view, log, m)
        for i in rec.undone:
            self._undone(view, log, i)
        for w in rec.ignored:
            self._ignored(view, log, w)

    def _misload(self, view: StepView, log: FindingLog, m: Misload) -> None:
        where = f"'{m.module}'" if m.module else "the model"
        named = [f"{m.module}.{k}" if m.module else k for k in m.missing]
        if m.pairs:
            a, b = m.pairs[0]
            what = (
                f"the state dict holds them under other names ('{b}' for '{a}'), so "
                f"{len(m.missing)} trained parameters keep their initial values"
            )
        else:
            what = f"it loaded no key at all: {len(m.missing)} trained parameters keep their initial values"
        when = " (before watch() began)" if m.before_watch else ""
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"load_state_dict(strict=False) into {where}{_at(m.site)}{when} missed "
            f"trained weights: {what}.",
            hint="Rename the keys before loading (strip or add the prefix: `{k.removeprefix("
            "'module.'): v for k, v in sd.items()}`) and check the missing keys it returns.",
            params=named,
            module=m.module or ROOT,
            details={
                "kind": "load_state_dict",
                "called_at": m.site,
                "missing": m.missing[:8],
                "pairs": [list(p) for p in m.pairs],
                "loaded": m.loaded,
                "before_watch": m.before_watch,
            },
            key=f"load:{m.module}:{m.site}",
        )

    def _undone(self, view: StepView, log: FindingLog, i: Intent) -> None:
        asked, undo, state = _UNDONE.get(i.kind, ("", "", ""))
        if i.kind in ("dtype", "device"):
            asked, undo = i.call, i.undo_call
            on = "in" if i.kind == "dtype" else "on"
            state = f"'s parameters are {on} {', '.join(i.at_step)} at the step, not {i.want}"
        by = f"'{i.undone_by}'" if i.undone_by else "the model"
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"'{i.module}'.{asked}{_at(i.site)} was undone before the step by "
            f"{undo} on {by}{_at(i.undone_at)}: the module{state}.",
            hint=f"Call '{i.module}'.{asked} after {undo} on its ancestor (at each epoch's "
            "start), or override the parent's method to keep it.",
            params=under(view.index, [i.module]),
            module=i.module,
            details={
                "kind": i.kind,
                "called_at": i.site,
                "undone_by": i.undone_by,
                "undone_at": i.undone_at,
                **(
                    {"wanted": str(i.want), "at_step": list(i.at_step)}
                    if i.kind in ("dtype", "device")
                    else {}
                ),
            },
            key=f"{i.kind}:{i.module}",
        )

    def _ignored(self, view: StepView, log: FindingLog, w: IgnoredWrite) -> None:
        where = {
            "attribute": f"as the optimizer attribute `opt.{w.hparam}`",
            "defaults": f"into `opt.defaults['{w.hparam}']` after construction",
            "other_optimizer": f"into another {w.other} over the same parameters, which "
            "is never stepped (a scheduler or a loop on an optimizer built before this one)",
        }[w.kind]
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{w.hparam} = {w.written} was written {where}; the step of optimizer "
            f"{w.k} reads its param groups, which hold {w.hparam} = {list(w.used)}.",
            hint=f"Write `for g in opt.param_groups: g['{w.hparam}'] = value` on the optimizer "
            "that steps, and build schedulers on it.",
            params=view.index.names(view.ids) if w.k == view.optimizer else None,
            details={
                "kind": w.kind,
                "hparam": w.hparam,
                "written": w.written,
                "used": list(w.used),
                "optimizer": w.k,
            },
            key=f"{w.kind}:{w.k}:{w.hparam}",
        )
