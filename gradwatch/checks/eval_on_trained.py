"""``eval_on_trained_samples``: an eval-mode forward on samples the model was trained on.

From ``data_as_fed``: the first eval-mode forwards of the watched model (whenever they
run: a validation after the last step too), their per-sample prints against the bounded
set of prints of the train-mode batches read so far. Fires (once) when at least half the
samples of an eval batch of >= 2 samples were trained on, and no eval forward of the run
ran on held-out samples: the validation set is (or overlaps) the training set. (A run that
also evaluates on held-out data measures train accuracy on purpose.) Train batches are read on a sample of steps, so the overlap
is a lower bound.

Correct and silent: a held-out split, an eval forward inside the training step on a batch
just trained on (a metric logged under no_grad while the model is in train mode is a
train-mode forward), eval before any training step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gradwatch.capture.facts import FED_EVAL, Fact
from gradwatch.checks._data_fed import DataFedConfig
from gradwatch.checks.base import Check, CheckConfig, WatchSettings
from gradwatch.checks.docs import CheckDoc

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog
    from gradwatch.checks.views import RunView

_SHARE = 0.5


class EvalOnTrainedSamples(Check):
    """Per eval-mode forward read: the share of its samples trained on."""

    id = "eval_on_trained_samples"
    maturity = "preview"
    Config = DataFedConfig
    config: DataFedConfig
    needs = frozenset({"data_as_fed"})
    facts = frozenset({FED_EVAL})
    doc = CheckDoc(
        summary="An eval-mode forward ran on samples the model was trained on: the "
        "validation data is (or overlaps) the training data.",
        why="Validation on trained samples measures memorisation: accuracy looks high, "
        "overfitting is invisible, and early stopping or model selection follow it.",
        causes=(
            "`val_loader = DataLoader(train_ds)`: the validation loader built on the "
            "training dataset.",
            "A split done after augmentation or duplication, or `random_split` applied "
            "twice with different seeds.",
            "The train and validation file lists that overlap.",
        ),
        fix="Validate on a held-out split: build the validation loader on data the "
        "training loader never yields.",
        detail="eval-mode forwards (the first 64, whenever they run) ran on samples the model was "
        "trained on (>= half of an eval batch's per-sample prints among the train batches' prints "
        "read), and no eval forward of the run ran on held-out samples: `val_loader = "
        "DataLoader(train_ds)`; `details.samples`, `details.trained`. Train accuracy measured in "
        "eval mode beside a held-out validation is fine",
    )

    def evidence(self) -> dict[str, int]:
        return {"data_as_fed": self.config.scan_steps}

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._trained: Optional[Fact] = None
        self._held_out = False

    def on_fact(self, fact: Fact, log: FindingLog) -> None:
        n, seen = int(fact.details["samples"]), int(fact.details["trained"])
        if n < 2 or fact.details.get("last_batch"):
            return  # a metric of the batch just trained on, in eval mode: not a validation
        if seen < _SHARE * n:
            self._held_out = True
        elif self._trained is None:
            self._trained = fact

    def on_run(self, view: RunView, log: FindingLog) -> None:
        fact = self._trained
        if fact is None or self._held_out:
            return
        d = fact.details
        n, seen = int(d["samples"]), int(d["trained"])
        log.emit(
            self.id,
            severity=self.severity,
            step=fact.step,
            message=f"An eval-mode forward at step {fact.step} ran on {seen} of {n} samples "
            "that were fed in training: the evaluation measures memorisation, not "
            "generalisation.",
            hint="Evaluate on a held-out split (a validation loader built on data the "
            "training loader never yields).",
            params=fact.params,
            module=d.get("module"),
            details={"samples": n, "trained": seen},
            key="eval",
        )
