"""``not_in_optimizer`` and ``frozen_in_optimizer``: which parameters the optimizers hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks.base import Check, StructureView

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
