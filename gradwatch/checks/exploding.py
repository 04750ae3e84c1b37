"""``exploding_grad``: a layer norm above ``max_norm`` or a spike over its running median.

On a spike, ``details.first_layers`` ranks the layers by how far each rose above its own
running median, each with the step where its rise began (spike attribution). The history
this needs is what the spike rule keeps already (one float per layer per kept step) plus
one step number per layer that is rising.

At a small batch (fewer than ``small_batch`` samples behind the step: the ``samples``
evidence) each gradient is a few samples' own, and per-sample gradient norms spread over
orders of magnitude (a well-fit sample's is tiny, a hard one's is not: 2e5 x the median on a
2-16-2 MLP trained one sample at a time, within 12 x the largest seen): the spike rule then
compares with the largest norm of the kept history, the top of that spread, not its median.
"""

from __future__ import annotations

from itertools import compress, repeat
from math import isfinite
from operator import gt, mul
from typing import TYPE_CHECKING, Any, Optional

from pydantic import Field, StrictFloat, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._window import MedianWindow, WindowColumns
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import LayerTable, StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

# A layer is rising while its norm is above this multiple of its running median; the step
# where that began is its ``rise_began``.
_RISE = 2.0
_FIRST_LAYERS = 5  # layers ranked in ``details.first_layers``


class ExplodingGradConfig(CheckConfig):
    """``exploding_grad``: absolute and relative limits on a layer's gradient L2 norm."""

    severity: Severity = severity_field("warning")
    max_norm: Optional[StrictFloat] = Field(
        default=1e4,
        gt=0,
        description="A layer gradient norm above this fires (null: no absolute limit).",
    )
    spike_factor: StrictFloat = Field(
        default=100.0,
        gt=1,
        description="A layer norm above spike_factor x its running median (of the kept history) fires.",
    )
    warmup: StrictInt = Field(
        default=10, ge=1, description="Observed steps of a layer before the spike rule applies."
    )
    small_batch: StrictInt = Field(
        default=8,
        ge=1,
        description="A step whose gradient comes from fewer samples than this is judged "
        "against the top of the per-sample spread (the largest norm of the kept history), "
        "not its median.",
    )


class ExplodingGrad(Check):
    """Per layer, on observed steps."""

    id = "exploding_grad"
    maturity = "stable"
    Config = ExplodingGradConfig
    doc = CheckDoc(
        summary="A layer's gradient norm exceeds max_norm, or jumps above spike_factor x its "
        "running median.",
        why="Huge updates undo training in one step and are the usual prelude to NaN losses.",
        causes=(
            "A learning rate too high for this layer or this phase of training.",
            "Missing normalisation or a bad initialisation.",
            "Outlier batches (a corrupted label, an empty sequence).",
        ),
        fix="Lower the learning rate, add warmup, clip gradients (clip_grad_norm_), check the "
        "input batch at the reported step.",
        silence=(
            "Raise the limits: checks: {exploding_grad: {max_norm: 1e6, spike_factor: 1000}}.",
        ),
        detail="a layer's gradient norm above `max_norm` (1e4) or above `spike_factor` (100) x "
        "its running median after `warmup` (10) observed steps. Spike attribution: "
        "`details.first_layers` ranks the layers whose norm rose most above their own running "
        "median (`ratio`, `norm`, `median`, `rise_began`: the first observed step of its rise "
        "above 2 x its median), `details.rise_began` the earliest; shown in the console (`spike:`) "
        "and HTML",
    )
    config: ExplodingGradConfig
    needs = frozenset({"samples"})

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._history: dict[str, MedianWindow] = {}
        self._rise_began: dict[str, int] = {}  # layers now rising: the step it began
        self._columns: Optional[WindowColumns] = None  # the windows of the last layout

    def _windows(self, names: list[str]) -> WindowColumns:
        """The windows of ``names``, cached for the last list of layers (a layout's own list:
        the same object each step; a list built per step: compared)."""
        cols = self._columns
        if cols is None or (cols.keys is not names and cols.keys != names):
            history, size = self._history, self.watch_config.history
            for x in names:
                if x not in history:
                    history[x] = MedianWindow(size)
            windows = [history[x] for x in names]
            cols = self._columns = WindowColumns(names, windows)  # type: ignore[arg-type]
        return cols

    def on_step(self, view: StepView, log: FindingLog) -> None:
        cfg = self.config
        table = LayerTable.of(view.layers)
        names, norms = table.names, table.norm
        if not names:
            return
        if not table.finite:  # a non-finite norm is nonfinite_grad's: not pushed, not judged
            rows = [r for r, v in enumerate(norms) if isfinite(v)]
            names, norms = [names[r] for r in rows], [norms[r] for r in rows]
            if not names:
                return
        cols = self._windows(names)
        held, meds, tops = cols.push(norms)  # each window before its norm, then the norm
        self._rising(names, norms, meds, cols.row, view.step)
        n = view.window.samples
        spread = n is not None and n < cfg.small_batch  # per-sample gradients
        refs = tops if spread else meds
        max_norm, factor = cfg.max_norm, cfg.spike_factor
        # One C-level screen over every layer; the exact rule below runs where it may fire.
        if not (
            (max_norm is not None and max(norms) > max_norm)
            or any(map(gt, norms, map(mul, refs, repeat(factor))))
        ):
            return
        fired: list[tuple[str, str]] = []
        what = "largest (per-sample gradients)" if spread else "median"
        for layer, norm, count, ref in zip(names, norms, held, refs):
            if max_norm is not None and norm > max_norm:
                fired.append((layer, f"gradient norm {norm:.3g} exceeds max_norm {max_norm:g}"))
            elif count >= cfg.warmup and ref > 0 and norm > factor * ref:
                fired.append(
                    (
                        layer,
                        f"gradient norm {norm:.3g} jumped to {norm / ref:.1f}x its "
                        f"running {what} {ref:.3g}",
                    )
                )
        if fired:
            medians = {x: m for x, m in zip(names, meds) if m > 0}
            self._emit(view, log, fired, self._attribution(view, medians))

    def _rising(
        self,
        names: list[str],
        norms: list[float],
        meds: list[float],
        row: dict[Any, int],
        step: int,
    ) -> None:
        """Layers above _RISE x their running median (over 0) are rising from the step it
        began; one at or below it stops; a layer without a median keeps its state."""
        rising = self._rise_began
        over = compress(range(len(norms)), map(gt, norms, map(mul, meds, repeat(_RISE))))
        up = [names[r] for r in over if meds[r] > 0]
        for layer in up:
            rising.setdefault(layer, step)
        if len(rising) == len(up):
            return  # only this step's risers are held
        ups = set(up)
        for layer in [x for x in rising if x not in ups]:
            r = row.get(layer)
            if r is not None and meds[r] > 0:
                del rising[layer]

    def _attribution(self, view: StepView, medians: dict[str, float]) -> dict[str, Any]:
        """The layers that rose most above their own running median, and when it began."""
        step, layers = view.step, view.layers
        ratios = {
            layer: (layers[layer].norm / med, layers[layer].norm, med)
            for layer, med in medians.items()
        }
        ranked = sorted(
            (item for item in ratios.items() if item[1][0] > _RISE), key=lambda kv: -kv[1][0]
        )[:_FIRST_LAYERS]
        first = [
            {
                "layer": layer,
                "ratio": ratio,
                "norm": norm,
                "median": med,
                "rise_began": self._rise_began.get(layer, step),
            }
            for layer, (ratio, norm, med) in ranked
        ]
        if not first:
            return {}
        began = min(self._rise_began.get(layer, step) for layer, _ in ranked)
        return {"first_layers": first, "rise_began": began}

    def _emit(
        self,
        view: StepView,
        log: FindingLog,
        fired: list[tuple[str, str]],
        attribution: dict[str, Any],
    ) -> None:
        for layer, reason in fired:
            sample = view.layers[layer]
            log.emit(
                self.id,
                severity=self.severity,
                step=view.step,
                message=f"layer '{layer}': {reason}.",
                hint="Lower the learning rate, clip gradients (clip_grad_norm_), check the "
                "initialisation scale and normalisation layers, or add warmup.",
                params=view.index.names([view.ids[k] for k in sample.positions]),
                module=layer,
                details={"norm": sample.norm, "max_norm": self.config.max_norm, **attribution},
            )
