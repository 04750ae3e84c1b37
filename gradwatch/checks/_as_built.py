"""What the checks of the model as built share: each layout read is judged once."""

from __future__ import annotations

from typing import Any, Optional

from gradwatch.checks.base import Check, CheckConfig, WatchSettings
from gradwatch.checks.views import StepView

__all__ = ["AsBuiltCheck"]


class AsBuiltCheck(Check):
    """A check over the ``built`` source's record (``model_as_built``)."""

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._judged = -1  # the layout revision judged last

    def fresh(self, view: StepView) -> Optional[Any]:
        """The step's ``BuiltModel`` when its layout was not judged yet, else ``None``."""
        built = view.window.records.get("built")
        if built is None or built.revision == self._judged:
            return None
        self._judged = built.revision
        return built
