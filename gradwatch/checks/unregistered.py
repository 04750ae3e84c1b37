"""``unregistered_param``: tensors that get gradients but are in no model and no optimizer.

Two kinds of evidence (``gradwatch/capture/forward/forward_scout.py``, ``gradwatch/capture/loss/loose.py``):
layers kept in a plain list/dict/tuple attribute of the model that run in its forward, and
*loose leaves*: tensors that persist across steps, receive gradients from the loss (seen in
the graph of ``Tensor.backward``'s root) and are in no watched model or optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictBool, StrictInt

from gradwatch._severity import Severity
from gradwatch.capture.forward.forward_scout import BUILT_IN_FORWARD
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class UnregisteredParamConfig(CheckConfig):
    """``unregistered_param``: modules in plain containers, and loose leaves, that train unseen."""

    severity: Severity = severity_field("error")
    scan_steps: StrictInt = Field(
        default=8,
        ge=0,
        le=1_000_000,
        description="Optimizer steps during which every module called inside the model's "
        "forward is compared with the registered ones (a global forward hook, on only "
        "during the model's forward; and the graph of each backward is walked for loose "
        "leaves). 0: never scan.",
    )
    loose_tensors: StrictBool = Field(
        default=True,
        description="Also look for loose leaves: tensors outside the model and every watched "
        "optimizer that get gradients from the loss on two steps and are never updated.",
    )


class UnregisteredParam(Check):
    """A module that runs in the model's forward, gets gradients, yet is not part of the model.

    Meaning: a tensor requiring grad received a gradient through a module called inside the
    watched model's forward that is not registered in the model, so it is in no
    ``named_parameters()``, no optimizer built from them and no ``state_dict``: it never
    trains and is never saved.

    Causes: submodules kept in a plain Python ``list``/``dict``/``tuple`` attribute
    (``self.blocks = [nn.Linear(...)]``), or a layer created inside ``forward``.

    Fix: use ``nn.ModuleList`` / ``nn.ModuleDict`` (or ``nn.Sequential``), and build layers in
    ``__init__``.

    Found from what actually runs (a global module forward hook, on only during the model's
    forward for the first ``scan_steps`` steps) and confirmed by a gradient arriving: an
    unregistered module that is frozen or runs under ``no_grad`` (a hidden EMA teacher) is
    not this bug. Named by attribute path, e.g. ``blocks[0].weight``.

    Loose leaves: during the same steps, the graph of each ``loss.backward()`` is walked from
    its root; a leaf tensor requiring grad that is in no watched model or optimizer, seen
    again (the same object) on a later step with its version counter unchanged, is loose: a
    margin head ``W = nn.Parameter(...)`` or a criterion module kept outside the model, a
    ``temperature = torch.tensor(0.07, requires_grad=True)`` attribute that is not an
    ``nn.Parameter``, loss weights missing from the optimizer. Tensors that require grad as
    inputs (adversarial examples, saliency, gradient-penalty interpolates) are new each step;
    a tensor an optimizer gradwatch does not watch updates changes version: neither fires.
    Named by the attribute or variable holding it, else by its shape and ``backward()`` line.
    The parameters of a module in eval mode (a teacher run without ``no_grad``) are a warning.
    """

    id = "unregistered_param"
    maturity = "stable"
    Config = UnregisteredParamConfig
    config: UnregisteredParamConfig
    needs = frozenset({"module_scan"})
    doc = CheckDoc(
        summary="A tensor that requires grad received a gradient through a module that runs in "
        "the forward but is not registered in the model.",
        why="Its parameters are in no `named_parameters()`, no optimizer and no `state_dict`: "
        "they are never trained, never saved, and not moved by `model.to(device)`.",
        causes=(
            "Submodules kept in a plain Python `list`, `dict` or `tuple` attribute "
            "(`self.blocks = [nn.Linear(...) for _ in range(4)]`).",
            "A module created inside `forward` and kept on a non-Module attribute.",
            "A loss head kept outside the model (ArcFace `W = nn.Parameter(...)` in the script, "
            "an `nn.Linear` criterion) while the optimizer gets only `model.parameters()`.",
            "A plain tensor attribute with `requires_grad=True` (`self.scale = torch.ones(1, "
            "requires_grad=True)`) instead of an `nn.Parameter`, or a parameter replaced by a "
            "re-created copy (`nn.Parameter(p.to(...))`) after the optimizer was built.",
        ),
        fix="Use `nn.ModuleList` / `nn.ModuleDict` (or `nn.ParameterList`) so the modules are "
        "registered; the finding names the attribute path, e.g. `blocks[0].weight`. For a "
        "loose tensor: make it an `nn.Parameter` of the model, or pass it to the optimizer "
        "(`AdamW([*model.parameters(), W])`).",
        silence=(
            "Tensors that require grad as inputs on purpose (adversarial examples, saliency, "
            "gradient penalties) are new objects each step and are never reported.",
            "A module in eval mode kept outside the model (a teacher run without "
            "`torch.no_grad()`) is a warning: run it under `no_grad` to silence it.",
            "`loose_tensors: false` turns the loose-leaf search off (`scan_steps: 0` both).",
        ),
        detail="a module kept in a plain `list`/`dict`/`tuple` attribute (or built inside "
        "`forward`) runs in the model's forward and gets gradients, but is in no "
        "`named_parameters()`, optimizer or `state_dict`. Named by attribute path "
        "(`blocks[0].weight`, `heads['a'].bias`). Also loose leaves: a tensor that requires grad, "
        "gets gradients from the loss and is in no watched model or optimizer (a margin head `W = "
        "nn.Parameter(...)` or a criterion module kept in the script, a plain "
        "`requires_grad=True` tensor attribute instead of an `nn.Parameter`, a parameter "
        "re-created by `nn.Parameter(p.to(...))` after the optimizer was built), seen in the "
        "graph of each `loss.backward()` and judged loose when the same object comes back on a "
        "later step unchanged; named by the attribute or variable holding it (`criterion.weight`, "
        "`temperature`, `W`), else its shape, with `details.backward_at`. Found during the first "
        "`scan_steps` (8) steps; unregistered frozen or `no_grad` modules, tensors held by an "
        "optimizer (a learnable temperature), inputs that require grad on purpose (adversarial "
        "examples, saliency, gradient-penalty interpolates: new objects each step) and tensors "
        "another, unwatched optimizer updates are fine; a module in eval mode outside the model "
        "(a teacher run without `torch.no_grad()`) is a warning. `loose_tensors: false` turns the "
        "loose-leaf search off",
    )

    def evidence(self) -> dict[str, Any]:
        """The scans, on for ``scan_steps`` optimizer steps."""
        steps = self.config.scan_steps
        return {"module_scan": steps, "loose_leaves": steps if self.config.loose_tensors else 0}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.window.loose:
            self._loose(view, log)
        if not view.window.unregistered:
            return
        by_module: dict[str, list[str]] = {}
        classes: dict[str, str] = {}
        for name, cls in view.window.unregistered:
            where = name.rsplit(".", 1)[0]
            by_module.setdefault(where, []).append(name)
            classes[where] = cls
        for where, names in by_module.items():
            container = where.split("[", 1)[0] if "[" in where else None
            built = BUILT_IN_FORWARD in where and where.startswith("<")
            if built:
                self._built(view, log, where, names, classes[where])
                continue
            fix = (
                f"Register it: replace the plain container '{container}' with nn.ModuleList / "
                "nn.ModuleDict (or nn.Sequential)"
                if container
                else "Create the layer in __init__ as an attribute of the model"
            )
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"{classes[where]} '{where}' runs in the model's forward and gets "
                f"gradients, but is not registered in the model: its {len(names)} parameter(s) "
                "are in no optimizer and no state_dict (never trained, never saved).",
                hint=f"{fix}; then rebuild the optimizer from model.parameters().",
                params=names,
                module=where,
                details={"module_class": classes[where], "container": container},
            )

    def _built(
        self, view: StepView, log: FindingLog, where: str, names: list[str], cls: str
    ) -> None:
        """A layer created inside ``forward``: a new random one at every call."""
        site = where.rsplit(" at ", 1)[1].rstrip(">") if " at " in where else None
        at = f" at {site}" if site else ""
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"A {cls} is built inside the model's forward{at} and gets gradients: a "
            f"new, randomly initialised {cls} at every call, so its {len(names)} "
            "parameter(s) are never trained (in no optimizer, no state_dict).",
            hint=f"Create the {cls} once in __init__ (self.<name> = nn.{cls}(...)) and call "
            "it in forward; then rebuild the optimizer from model.parameters().",
            params=names,
            module=where,
            details={
                "module_class": cls,
                "container": None,
                "cause": "built_in_forward",
                "called_at": site,
            },
        )

    def _loose(self, view: StepView, log: FindingLog) -> None:
        by_owner: dict[str, list[Any]] = {}
        for leaf in view.window.loose:
            by_owner.setdefault(leaf.owner, []).append(leaf)
        for owner, leaves in by_owner.items():
            names = [leaf.name for leaf in leaves]
            first = leaves[0]
            what = "nn.Parameter" if first.parameter else "tensor (requires_grad=True)"
            at = f" (its gradient comes from the backward() at {first.backward_at})"
            at = at if first.backward_at else ""
            shapes = ", ".join(str(list(leaf.shape)) for leaf in leaves[:3])
            teacher = all(leaf.in_eval for leaf in leaves)  # a module in eval: not to train?
            copied = first.copied and not teacher
            log.emit(
                self.id,
                severity="warning" if teacher and self.severity == "error" else self.severity,
                step=view.step,
                message=f"'{owner}': {len(names)} {what}(s) of shape {shapes} get gradients from "
                f"the loss, step after step{at}, but are in no watched model and "
                + (
                    "only in an optimizer gradwatch does not watch, whose step() never moved them: "
                    if first.held
                    else "no optimizer: "
                )
                + "nothing ever updates them (and no model state_dict saves them).",
                hint=(
                    f"'{owner}' is in eval mode: a teacher or reference model? Run it under "
                    f"torch.no_grad() (or {owner}.requires_grad_(False)): its gradients cost "
                    "memory and time for nothing."
                    if teacher
                    else f"'{owner}' holds a tensor computed from an nn.Parameter (e.g. "
                    "nn.Parameter(t).to(...) keeps .to()'s copy, and the Parameter itself is "
                    "registered nowhere): convert first, then wrap, nn.Parameter(t.to(...)), "
                    "and rebuild the optimizer."
                    if copied
                    else f"Pass '{owner}' to the optimizer (e.g. AdamW([*model.parameters(), "
                    "*extra])), or make it an nn.Parameter / submodule of the model; if it "
                    "must not train, create it with requires_grad=False or use it under "
                    "torch.no_grad()."
                ),
                params=names,
                module=None,
                key=f"loose:{owner}",
                details={
                    "cause": "loose",
                    "shapes": [list(leaf.shape) for leaf in leaves],
                    "parameter": first.parameter,
                    "backward_at": first.backward_at,
                    "in_eval": teacher,
                    "copied": copied,
                    "held": first.held,
                },
            )
