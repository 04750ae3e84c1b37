"""``batch_repeated``: the same batch fed again before the data was exhausted.

From ``data_as_fed``: each read step's train-mode batches, as ordered per-sample prints
(the tensor as fed: after augmentation). A batch's key is its prints in order, so a
shuffled loader never repeats one, while an unshuffled epoch repeats every batch with the
epoch's period. Fires (once) when a batch of >= 2 samples comes back

- sooner (in steps) than the number of steps that fed a new batch so far (an epoch is at
  least as long as the steps it holds: ``batches[0]`` after ``batches[1..]``, a constant
  index; micro-batches of one step count once), or
- and new batches keep arriving afterwards (a repeat that was not an epoch boundary: a
  ``next(iter(loader))`` batch interleaved with a loader that still has data).

One batch fed at every step from the start is not judged: an overfit-one-batch test,
a dataset of one batch, or an iterator re-created each step (``next(iter(loader))`` in the
loop, a ``DataLoader`` built inside it): the prints cannot tell which.

Correct and silent: epochs of an unshuffled loader (the period equals the epoch), shuffled
epochs, augmented views of the same images, two views or two forwards within one step
(contrastive pairs, GAN real and fake batches), inputs that require grad (a generator's
output fed to a discriminator, again after its step), eval forwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks._data_fed import DataFedConfig, fed_record, first_layer
from gradwatch.checks.base import Check, CheckConfig, WatchSettings
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView
from gradwatch.sources.data_fed import DataFedRecord

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_KEYS = 1 << 16  # batch keys kept


class BatchRepeated(Check):
    """Per read step: batch keys against those of earlier steps."""

    id = "batch_repeated"
    maturity = "preview"
    Config = DataFedConfig
    config: DataFedConfig
    needs = frozenset({"data_as_fed"})
    doc = CheckDoc(
        summary="The same batch (the same samples, in the same order) was fed again before "
        "the data was exhausted: within an epoch's worth of steps.",
        why="The model trains on a fraction of the data: the loss falls on the repeated "
        "batch (it memorises it) while the rest of the dataset is never seen, and the run "
        "looks like it learns.",
        causes=(
            "`next(iter(loader))` inside the training loop: a new iterator each step "
            "yields the first batch again.",
            "A `DataLoader` (or its iterator) created inside the loop.",
            "A list of batches indexed with a constant (`batches[0]`) or a stale index.",
        ),
        fix="Create the iterator once per epoch (`for x, y in loader:`), or keep one "
        "iterator and re-create it only on StopIteration.",
        detail="the same batch (the same samples in the same order, as fed: after augmentation) "
        "came back before the data was exhausted: sooner than the number of distinct batches "
        "already seen, or with new batches still arriving after it (a constant or stale index "
        "into a list of batches, each batch fed twice, `next(iter(loader))` mixed with a loader). "
        "Read by the `data_as_fed` source: per-sample strided prints (a few int64 per sample, no "
        "copy of the data) of the model's first input on the first `scan_steps` (16) steps and a "
        "thinning sample after; `details.first_step`, `details.distinct_batches`. One batch at "
        "every step from step 0 is not judged (an overfit test, a one-batch dataset or an "
        "iterator re-created each step: not told apart); epochs of an unshuffled loader, shuffled "
        "epochs, two views or forwards per step are fine. An iterator re-created every k steps "
        "cycles like a k-batch dataset: not judged",
    )

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._last: dict[int, int] = {}  # batch key -> last step fed
        self._count: dict[int, int] = {}
        self._repeat: tuple[int, int, int] | None = None  # (key, first step, step)
        self._new_after = 0
        self._new_steps: set[int] = set()  # steps that fed a batch never seen before
        self._done = False

    def evidence(self) -> dict[str, int]:
        return {"data_as_fed": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = fed_record(view)
        if rec is None or self._done:
            return
        keys = {hash(tuple(f.prints)): len(f.prints) for f in rec.fed if not f.made}
        for key, n in keys.items():
            last = self._last.get(key)
            if last is None:
                if len(self._last) < _KEYS:
                    self._last[key] = view.step
                    self._count[key] = 1
                self._new_after += self._repeat is not None
                if len(self._new_steps) < _KEYS:
                    self._new_steps.add(view.step)
                continue
            self._count[key] += 1
            # in steps: several batches per step (accumulation, skipped steps) are one step
            gap, distinct = view.step - last, len(self._new_steps)
            self._last[key] = view.step
            if len(self._last) == 1:  # one batch from the start: on purpose, not judged
                continue
            if n < 2:
                continue
            if self._repeat is None:
                self._repeat = (key, last, view.step)
            if gap < distinct:
                self._emit(
                    view,
                    log,
                    rec,
                    last,
                    f"{gap} step(s) after it was fed, while {distinct} steps fed new batches",
                )
                return
        if self._repeat is not None and self._new_after >= 2:
            _, first, at = self._repeat
            self._emit(
                view,
                log,
                rec,
                first,
                f"at step {at}, and {self._new_after} batches never seen before arrived after it",
            )

    def _emit(
        self, view: StepView, log: FindingLog, rec: DataFedRecord, first: int, how: str
    ) -> None:
        self._done = True
        params, module = first_layer(rec)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"A batch first fed at step {first} was fed again {how}: the same samples "
            "came back before the data was exhausted.",
            hint="Create the data iterator once per epoch (`for x, y in loader:`), not "
            "`next(iter(loader))` inside the loop; index batches with the step.",
            params=params,
            module=module,
            details={"first_step": first, "distinct_batches": len(self._last)},
            key="repeat",
        )
