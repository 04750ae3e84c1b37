"""``param_outside_model``: an optimizer holds tensors that are not parameters of the model.

Always on and not configurable. The layout (``core/structure.py``) records them as a
:data:`~gradwatch.capture.facts.FOREIGN_TENSORS` fact when it first sees them; they are
watched under synthesized names, so this ``info`` says why the names look that way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.capture.facts import FOREIGN_TENSORS, Fact
from gradwatch.checks._ghost_groups import replaced_layers
from gradwatch.checks.base import Check, CheckConfig
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StructureView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog
    from gradwatch.model.index import ParamIndex

__all__ = ["ParamOutsideModel"]


class ParamOutsideModelConfig(CheckConfig):
    """``param_outside_model`` (not part of the user's config: always on)."""

    severity: Severity = Field(default="info", description="Severity of its findings.")


class ParamOutsideModel(Check):
    """Optimizer tensors outside the watched model, watched under synthesized names.

    When they have the shapes of model parameters that no optimizer holds, the whole model
    is watched and a layer of it was replaced after the optimizer was built (or after
    ``watch()`` began, when those tensors were once the model's): the finding says that,
    not "watch the whole model".
    """

    id = "param_outside_model"
    maturity = "stable"
    Config = ParamOutsideModelConfig
    facts = frozenset({FOREIGN_TENSORS})
    doc = CheckDoc(
        summary="An optimizer holds tensors that are not parameters of the watched model; they "
        "are watched under synthesized names.",
        why="Findings about them cannot name the module they belong to.",
        causes=(
            "`watch()` was given a submodule while the optimizer holds the whole model.",
            "A layer was replaced (`model.fc = nn.Linear(...)`) after the optimizer was built: "
            "the optimizer still holds the old tensors.",
        ),
        fix="Watch the whole model the optimizer trains; after replacing a layer, rebuild the "
        "optimizer (and `watcher.add_optimizer(...)` it when already watching).",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._index: Optional[ParamIndex] = None
        self._was_model: set[int] = set()  # ids seen as the model's own parameters

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._index = view.index
        self._was_model.update(i.idx for i in view.index.params if not i.outside_model)

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        index = self._index
        wanted = set(fact.params or [])
        outside = (
            [i.idx for i in index.params if i.outside_model and set(i.names) & wanted]
            if index is not None
            else []
        )
        replaced = replaced_layers(index, outside) if index is not None and outside else []
        if not replaced:
            super().on_fact(fact, log)
            return
        after = any(i in self._was_model for i in outside)
        when = "after watch() began" if after else "after the optimizer was built"
        layers = ", ".join(f"'{x}'" for x in replaced)
        log.emit(
            self.id,
            severity=self.severity,
            step=fact.step,
            message=f"{len(outside)} optimizer tensor(s) are the old parameters of {layers} "
            f"(same shapes), replaced {when}: the optimizer still holds them, and the new "
            "ones are in no optimizer; watched under synthesized names.",
            hint="The layer was replaced: rebuild the optimizer from model.parameters()"
            + (", then watcher.add_optimizer(new_optimizer)" if after else "")
            + " (or add_param_group() the new layer's parameters); see ghost_param "
            "(cause: not_in_model) and not_in_optimizer.",
            params=fact.params,
            key=fact.key,
            details={**fact.details, "replaced": replaced, "after_watch": after},
        )
