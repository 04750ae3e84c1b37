"""``not_in_optimizer`` and ``frozen_in_optimizer``: which parameters the optimizers hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks._grouping import WHOLE, by_subtree, label, numel_of
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView, StructureView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class NotInOptimizerConfig(CheckConfig):
    """``not_in_optimizer``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


class FrozenInOptimizerConfig(CheckConfig):
    """``frozen_in_optimizer``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("info")


def _by_layer(view: StructureView, idxs: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in idxs:
        out.setdefault(view.index.params[i].layer, []).append(i)
    return out


class NotInOptimizer(Check):
    """A trainable parameter of the model that no watched optimizer holds.

    ``warning`` once one of them receives a gradient (it is trained by mistake, or the
    optimizer was built over another copy of the model); until then ``info``: an
    EMA/SWA copy (``AveragedModel``) kept in the model with ``requires_grad=True`` is
    updated by hand and never receives one.
    """

    id = "not_in_optimizer"
    maturity = "stable"
    Config = NotInOptimizerConfig
    counts_toward_share = True
    doc = CheckDoc(
        summary="A trainable parameter of the model is in no watched optimizer (warning once "
        "it receives gradients, info while it never has).",
        why="It gets gradients (costing compute) but never changes; the model trains with a "
        "part frozen at its initial values.",
        causes=(
            "The optimizer was built before a layer was added or replaced.",
            "Param groups built by name that miss some parameters.",
            "An EMA/SWA copy left with requires_grad=True (then info: it gets no gradient).",
        ),
        fix="Build the optimizer from model.parameters() after the model is complete, or "
        "requires_grad_(False) on parameters that should not train.",
        detail="a trainable parameter in no watched optimizer that receives gradients; `info` "
        "while it never has (an EMA/SWA copy such as `AveragedModel` kept in the model). A "
        "subtree left out of the optimizer is one finding naming it (`module: encoder`). When the "
        "warnings and errors of `ghost_param`, `stale_param` and `not_in_optimizer` together hold "
        "more than half of the model's trainable elements, each is an error "
        "(`details.model_share`): lr 0 everywhere fails",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._idle: dict[str, list[int]] = {}  # group key -> orphans, no gradient seen yet

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._idle = {}
        if not view.has_optimizer:
            return
        orphans = [
            i
            for i in view.trainable
            if i not in view.in_optimizer and not view.index.params[i].outside_model
        ]
        universe = [i for i in view.trainable if not view.index.params[i].outside_model]
        for root, idxs in by_subtree(view.index, orphans, universe).items():
            key = root or WHOLE
            finding = log.get(self.id, key)
            if finding is not None and finding.details.get("receives_grad"):
                continue  # already seen receiving gradients
            self._idle[key] = idxs
            if finding is not None:
                continue
            log.emit(
                self.id,
                severity="info",
                step=int(view.extra.get("step", 0)),
                message=f"{_what(view, root, idxs)} in no optimizer "
                "(no gradient so far: an EMA/SWA copy?).",
                hint="Harmless for a copy updated by hand (AveragedModel, EMA); freeze it with "
                "requires_grad_(False) to say so. If it should train, add it to the optimizer.",
                params=view.index.names(idxs),
                module=root or None,
                details=_details(view, idxs),
                key=key,
            )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if not self._idle:
            return
        for key, idxs in list(self._idle.items()):
            if not any(view.received(i) for i in idxs):
                continue
            del self._idle[key]
            root = "" if key == WHOLE else key
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"{_what(view, root, idxs)} in no optimizer: they get gradients but "
                "never change.",
                hint="Build the optimizer from model.parameters() once the model is complete, "
                "or add_param_group() them; a teacher/EMA copy: requires_grad_(False).",
                params=view.index.names(idxs),
                module=root or None,
                details={**_details(view, idxs), "receives_grad": True},
                key=key,
            )


def _layers(view: StructureView | StepView, idxs: list[int]) -> list[str]:
    return list(dict.fromkeys(view.index.params[i].layer for i in idxs))


def _what(view: StructureView | StepView, root: str, idxs: list[int]) -> str:
    """``2 trainable parameter(s) of 'head' are`` or ``74 trainable parameters in 37 layers
    of 'encoder' are``: a subtree left out of the optimizer is named once."""
    layers = _layers(view, idxs)
    if len(layers) == 1 and layers[0] == root:
        return f"{len(idxs)} trainable parameter(s) of '{root}' are"
    return f"{len(idxs)} trainable parameters in {len(layers)} layers of {label(root)} are"


def _details(view: StructureView | StepView, idxs: list[int]) -> dict[str, object]:
    layers = _layers(view, idxs)
    out: dict[str, object] = {"numel": numel_of(view.index, idxs)}
    if len(layers) > 1:
        out["layers"] = layers
    return out


class FrozenInOptimizer(Check):
    """A parameter with ``requires_grad=False`` inside an optimizer (harmless, often intended)."""

    id = "frozen_in_optimizer"
    maturity = "stable"
    Config = FrozenInOptimizerConfig
    doc = CheckDoc(
        summary="A parameter with requires_grad=False sits in an optimizer.",
        why="Harmless while it gets no gradient, but weight decay or momentum can still move "
        "it (see frozen_param_updated), and it costs optimizer state.",
        causes=("A backbone frozen after the optimizer was built.",),
        fix="Fine for a backbone unfrozen later; otherwise build the optimizer from trainable "
        "parameters only.",
        detail="a `requires_grad=False` parameter inside an optimizer (also when frozen mid-run)",
    )

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        frozen = [i for i in view.frozen if i in view.in_optimizer]
        for layer, idxs in _by_layer(view, frozen).items():
            log.emit(
                self.id,
                severity=self.severity,
                step=int(view.extra.get("step", 0)),
                message=f"{len(idxs)} frozen parameter(s) of '{layer}' sit in an optimizer.",
                hint="Fine for a backbone unfrozen later; otherwise leave them out of the "
                "optimizer to save its state memory.",
                params=view.index.names(idxs),
                module=layer,
            )
