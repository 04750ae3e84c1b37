"""``inputs_unscaled``: the model's float input is far from any normalised scale.

From ``data_as_fed`` (the first train-mode forwards): the input's per-feature standard
deviations (a float ``(n, f)`` batch) and the value range of a strided subset. Two forms
of one property (a layer without normalisation gets inputs whose scale it cannot absorb):

- tabular: features of one input whose standard deviations differ by ``>= ratio`` (1e3)
  while the largest is >= 10 (an income in dollars next to a ratio in [0, 1]);
- images: a float input of >= 3 dims holding integral values in [0, 255] with a largest
  value > 10 (raw pixel values, ``ToTensor`` or a division by 255 forgotten).

Fires (once) when at least two read forwards show it and the first module with parameters
that runs is not a normalisation layer (BatchNorm, LayerNorm, GroupNorm, InstanceNorm: the
model normalises itself).

Correct and silent: token ids (integer tensors), one-hot and binary features, normalised
images, standardised tables, coordinates of one scale, near-constant features (a
feature's std is compared only when the largest is >= 10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from pydantic import Field, StrictFloat

from gradwatch._severity import Severity
from gradwatch.capture.forward.data_fed import Fed
from gradwatch.checks._data_fed import DataFedConfig, fed_record, first_layer
from gradwatch.checks.base import Check, CheckConfig, WatchSettings, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView
from gradwatch.sources.data_fed import DataFedRecord

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_LARGE = 10.0  # a feature scale that is not normalised
_PIXELS = 255.0
_SEEN = 2  # read forwards that must show it


class InputsUnscaledConfig(DataFedConfig):
    """``inputs_unscaled``: the ratio of feature scales that fires."""

    severity: Severity = severity_field("warning")

    ratio: StrictFloat = Field(
        default=1e3,
        gt=1.0,
        description="Largest over smallest per-feature std of one float input that fires.",
    )


class InputsUnscaled(Check):
    """Per read forward: its input's feature scales and value range."""

    id = "inputs_unscaled"
    maturity = "stable"
    Config = InputsUnscaledConfig
    config: InputsUnscaledConfig
    needs = frozenset({"data_as_fed"})
    doc = CheckDoc(
        summary="The model's float input is not normalised: its features' scales differ by "
        "orders of magnitude, or raw pixel values (0..255) are fed as floats.",
        why="The first layer's gradients are dominated by the large features: one learning "
        "rate is too large for them and too small for the rest, training is slow or "
        "diverges, and the small features are ignored.",
        causes=(
            "Tabular data fed without standardisation (`StandardScaler`, `(x - mean) / std`).",
            "Images converted with `torch.tensor(np_array).float()` instead of `ToTensor` "
            "(values 0..255).",
            "A normalisation computed but applied to another tensor than the one fed.",
        ),
        fix="Standardise each feature with the training set's mean and std (or divide "
        "images by 255 and normalise), or put a normalisation layer first.",
        detail="the model's float input is not normalised and no normalisation layer reads it "
        "first: the per-feature standard deviations of a float `(n, f)` input differ by >= "
        "`ratio` (1e3) with the largest >= 10 (tabular data not standardised), or a float input "
        "of >= 3 dims holds integral values in [0, 255] above 10 (raw pixels); seen on >= 2 of "
        "the first read forwards; `details.std_min`, `details.std_max`, `details.feature_max` or "
        "`details.max`. Token ids, one-hot, normalised images and tables, a BatchNorm/LayerNorm "
        "first are fine",
    )

    def __init__(self, config: CheckConfig, watch_config: WatchSettings) -> None:
        super().__init__(config, watch_config)
        self._seen = 0
        self._done = False

    def evidence(self) -> dict[str, int]:
        return {"data_as_fed": self.config.scan_steps}

    def _what(self, fed: Fed) -> Optional[tuple[str, dict[str, float]]]:
        if fed.scales:
            s = [v for v in fed.scales if v > 0]
            if s and max(s) >= _LARGE and max(s) >= self.config.ratio * min(s):
                big, small = max(s), min(s)
                return (
                    f"its features' standard deviations range from {small:.3g} to {big:.3g} "
                    f"(a ratio of {big / small:.3g})",
                    {"std_min": small, "std_max": big, "feature_max": fed.scales.index(big)},
                )
        r = fed.range
        if r and fed.dims >= 3 and r[0] >= 0 and _LARGE < r[1] <= _PIXELS and r[2] > 0.999:
            return f"integral values in [{r[0]:.0f}, {r[1]:.0f}] (raw pixels)", {"max": r[1]}
        return None

    def on_step(self, view: StepView, log: FindingLog) -> None:
        rec = fed_record(view)
        if self._done or rec is None or (rec.first is not None and rec.first[2]):
            return
        for fed in rec.fed:
            what = self._what(fed)
            if what is None:
                continue
            self._seen += 1
            if self._seen >= _SEEN:
                self._emit(view, log, rec, *what)
                return

    def _emit(
        self, view: StepView, log: FindingLog, rec: DataFedRecord, what: str, d: dict[str, float]
    ) -> None:
        self._done = True
        params, module = first_layer(rec)
        where = f"'{module}'" if module else "the model"
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"The input fed to {where} is not normalised: {what}, and no "
            "normalisation layer reads it first.",
            hint="Standardise the input with the training set's statistics "
            "(`(x - mean) / std` per feature; images: `/ 255` then Normalize).",
            params=params,
            module=module,
            details=d,
            key="unscaled",
        )
