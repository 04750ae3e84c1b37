"""``not_in_optimizer`` and ``frozen_in_optimizer``: which parameters the optimizers hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks.base import Check, StructureView
from gradwatch.checks.docs import CheckDoc

if TYPE_CHECKING:
    from gradwatch.core.findings import FindingLog


def _by_layer(view: StructureView, idxs: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in idxs:
        out.setdefault(view.index.params[i].layer, []).append(i)
    return out


class NotInOptimizer(Check):
    """A trainable parameter of the model that no watched optimizer holds."""

    id = "not_in_optimizer"
    doc = CheckDoc(
        summary="A trainable parameter of the model is in no watched optimizer.",
        why="It gets gradients (costing compute) but never changes; the model trains with a "
        "part frozen at its initial values.",
        causes=(
            "The optimizer was built before a layer was added or replaced.",
            "Param groups built by name that miss some parameters.",
            "An EMA/SWA copy left with requires_grad=True (then info: it gets no gradient).",
        ),
        fix="Build the optimizer from model.parameters() after the model is complete, or "
        "requires_grad_(False) on parameters that should not train.",
        severity="warning",
    )

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        if not view.has_optimizer:
            return
        orphans = [
            i
            for i in view.trainable
            if i not in view.in_optimizer and not view.index.params[i].outside_model
        ]
        for layer, idxs in _by_layer(view, orphans).items():
            log.emit(
                self.id,
                severity=self.severity,
                step=int(view.extra.get("step", 0)),
                message=f"{len(idxs)} trainable parameter(s) of '{layer}' are in no optimizer: "
                "they get gradients but never change.",
                hint="Build the optimizer from model.parameters() after the model is complete, "
                "or add them with optimizer.add_param_group(); freeze them if intended.",
                params=view.index.names(idxs),
                module=layer,
            )


class FrozenInOptimizer(Check):
    """A parameter with ``requires_grad=False`` inside an optimizer (harmless, often intended)."""

    id = "frozen_in_optimizer"
    doc = CheckDoc(
        summary="A parameter with requires_grad=False sits in an optimizer.",
        why="Harmless while it gets no gradient, but weight decay or momentum can still move "
        "it (see frozen_param_updated), and it costs optimizer state.",
        causes=("A backbone frozen after the optimizer was built.",),
        fix="Fine for a backbone unfrozen later; otherwise build the optimizer from trainable "
        "parameters only.",
        severity="info",
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
