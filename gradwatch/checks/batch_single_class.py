"""``batch_single_class``: consecutive batches that each hold one class, in a run of several.

The targets: class indices given to ``cross_entropy``/``nll_loss`` (``loss_inputs``, on the
loss scan's steps: their smallest and largest index) and integer 1-D tensors passed to the
model with its input (``data_as_fed``). A batch holds one class when its smallest and
largest index agree. Fires (once) when, over the read steps with batches of >= 4 samples,
at least ``runs`` and at least 3/4 of the batches each held one class, and those single
classes were >= 2 different ones: the data is fed in class order (an unshuffled,
class-sorted dataset), and each step pulls the model toward one class.

Correct and silent: shuffled batches, small batches, a run with one class so far,
imbalanced data whose batches often hold the majority class only (one single class),
regression targets (float).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._data_fed import DataFedConfig, fed_record, first_layer
from gradwatch.checks.base import Check, CheckConfig, WatchSettings, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView
from gradwatch.sources.data_fed import DataFedRecord

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_ROWS = 4  # batches smaller than this hold one class by chance too often
_SHARE = 0.75  # of the read batches, single-class
_CLASS_LOSSES = frozenset({"cross_entropy", "nll_loss"})


class BatchSingleClassConfig(DataFedConfig):
    """``batch_single_class``: how many single-class batches in a row it takes."""

    severity: Severity = severity_field("warning")

    runs: StrictInt = Field(
        default=3,
        ge=2,
        le=1000,
        description="Single-class batches (of >= 2 classes) it takes to fire.",
    )


def _ranges(view: StepView) -> list[tuple[int, int]]:
    """The step's target index ranges (smallest, largest)."""
    out: list[tuple[int, int]] = []
    rec = fed_record(view)
    if rec is not None:
        for fed in rec.fed:
            out.extend(fed.labels)
    dom = view.window.records.get("loss_domain")
    for call in getattr(dom, "calls", []):
        if call.loss not in _CLASS_LOSSES:
            continue
        for d, v in zip(call.demands, call.values):
            if d.domain == "index" and len(v) >= 2 and v[0] <= v[1]:
                out.append((int(v[0]), int(v[1])))
    return out


class BatchSingleClass(Check):
    """Per read step: whether its targets hold one class."""

    id = "batch_single_class"
    maturity = "stable"
    Config = BatchSingleClassConfig
    config: BatchSingleClassConfig
    needs = frozenset({"data_as_fed", "loss_inputs"})
    doc = CheckDoc(
        summary="Consecutive batches each held one class while the run has several: the "
        "data is fed in class order.",
        why="Each step pulls the model toward the batch's class: the loss oscillates, the "
        "model predicts the last class it saw, and batch-norm statistics describe one "
        "class at a time.",
        causes=(
            "`DataLoader(ds, shuffle=False)` on a dataset sorted by label (ImageFolder, a "
            "CSV grouped by class).",
            "Batches built per class (`for c in classes: for x in data[c]: ...`).",
            "A sampler that yields indices in label order.",
        ),
        fix="Shuffle the training data (`DataLoader(ds, shuffle=True)`), or interleave the "
        "classes.",
        detail="over the read steps with batches of >= 4 samples, at least `runs` (3) and at "
        "least 3/4 of the batches each held one class, and those single classes were >= 2 "
        "different ones (targets: class indices given to `cross_entropy`/`nll_loss`, or integer "
        "1-D tensors passed to the model): an unshuffled, class-sorted dataset; `details.single`, "
        "`details.read`, `details.classes_seen`. Shuffled data, imbalanced data whose batches "
        "often hold the majority class only, one class so far, float targets are fine",
    )

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._single_classes: set[int] = set()
        self._read = 0
        self._single = 0
        self._done = False

    def evidence(self) -> dict[str, int]:
        return {"data_as_fed": self.config.scan_steps, "loss_inputs": self.config.scan_steps}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = fed_record(view)
        if self._done or rec is None:
            return
        ranges = _ranges(view)
        rows = min((len(f.prints) for f in rec.fed), default=0)
        if not ranges or rows < _ROWS:
            return
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        self._read += 1
        if lo == hi:
            self._single += 1
            self._single_classes.add(lo)
        if (
            self._single >= self.config.runs
            and len(self._single_classes) >= 2
            and self._single >= _SHARE * self._read
        ):
            self._emit(view, log, rec, lo)

    def _emit(self, view: StepView, log: FindingLog, rec: DataFedRecord, cls: int) -> None:
        self._done = True
        params, module = first_layer(rec)
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{self._single} of {self._read} batches read each held a single class, "
            f"{len(self._single_classes)} different classes among them (the last: class {cls}): "
            "the data is fed in class order.",
            hint="Shuffle the training data: `DataLoader(dataset, shuffle=True)`.",
            params=params,
            module=module,
            details={
                "single": self._single,
                "read": self._read,
                "classes_seen": sorted(self._single_classes)[:16],
            },
            key="single_class",
        )
