"""``param_outside_model``: an optimizer holds tensors that are not parameters of the model.

Always on and not configurable. The layout (``core/structure.py``) records them as a
:data:`~gradwatch.capture.facts.FOREIGN_TENSORS` fact when it first sees them; they are
watched under synthesized names, so this ``info`` says why the names look that way.
"""

from __future__ import annotations

from pydantic import Field

from gradwatch._severity import Severity
from gradwatch.capture.facts import FOREIGN_TENSORS
from gradwatch.checks.base import Check, CheckConfig
from gradwatch.checks.docs import CheckDoc

__all__ = ["ParamOutsideModel"]


class ParamOutsideModelConfig(CheckConfig):
    """``param_outside_model`` (not part of the user's config: always on)."""

    severity: Severity = Field(default="info", description="Severity of its findings.")


class ParamOutsideModel(Check):
    """Optimizer tensors outside the watched model, watched under synthesized names."""

    id = "param_outside_model"
    Config = ParamOutsideModelConfig
    facts = frozenset({FOREIGN_TENSORS})
    doc = CheckDoc(
        summary="An optimizer holds tensors that are not parameters of the watched model; they "
        "are watched under synthesized names.",
        why="Findings about them cannot name the module they belong to.",
        causes=("`watch()` was given a submodule while the optimizer holds the whole model.",),
        fix="Watch the whole model the optimizer trains.",
    )
