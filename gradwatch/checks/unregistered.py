"""``unregistered_param``: layers in a plain list/dict/tuple attribute that run but never train."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class UnregisteredParamConfig(CheckConfig):
    """``unregistered_param``: modules in plain list/dict/tuple attributes that train unseen."""

    severity: Severity = severity_field("error")
    scan_steps: StrictInt = Field(
        default=8,
        ge=0,
        le=1_000_000,
        description="Optimizer steps during which every module called inside the model's "
        "forward is compared with the registered ones (a global forward hook, on only "
        "during the model's forward). 0: never scan.",
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
    """

    id = "unregistered_param"
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
        ),
        fix="Use `nn.ModuleList` / `nn.ModuleDict` (or `nn.ParameterList`) so the modules are "
        "registered; the finding names the attribute path, e.g. `blocks[0].weight`.",
    )

    def evidence(self) -> dict[str, Any]:
        """The scan for unregistered modules, on for ``scan_steps`` optimizer steps."""
        return {"module_scan": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
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
            fix = (
                f"Register it: replace the plain container '{container}' with nn.ModuleList / "
                "nn.ModuleDict (or nn.Sequential)"
                if container
                else "Create the layer in __init__ as an attribute of the model (a new layer "
                "built inside forward is random at every call)"
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
