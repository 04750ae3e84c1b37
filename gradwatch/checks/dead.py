"""``dead_param``: every gradient of a layer exactly zero (a dead ReLU layer).

A single parameter whose gradient is zero while the rest of its layer learns (a bias that a
following normalisation cancels) is not a dead layer: it is reported at ``info`` at most.

The streak must also cover ``min_samples`` samples (the ``samples`` evidence: the batches
behind each step): at batch size 1, three zero gradients in a row are three samples for which
no unit of a ReLU layer fired, not a dead layer.
"""

from __future__ import annotations

from math import isfinite
from typing import TYPE_CHECKING

from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._grouping import by_flow
from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import LayerTable, StepView, StructureView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class DeadParamConfig(CheckConfig):
    """``dead_param``: every gradient of a layer is exactly zero."""

    severity: Severity = severity_field("warning")
    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )
    min_samples: StrictInt = Field(
        default=16,
        ge=1,
        description="Samples (the batches' leading dim) those steps' gradients must cover "
        "together: at batch size 1 a few zero gradients are a few samples no unit fired for.",
    )


class DeadParam(Check):
    """Per layer, on observed steps."""

    id = "dead_param"
    maturity = "stable"
    Config = DeadParamConfig
    doc = CheckDoc(
        summary="Every gradient of a layer is exactly zero for patience observed steps.",
        why="The layer is alive in the optimizer but nothing flows through it: typically ReLU "
        "units that never fire again, so capacity is lost for the rest of training.",
        causes=(
            "Dead ReLUs after a too-large update or a negative bias.",
            "A saturated activation or a mask that zeroes the layer's input.",
            "A single redundant parameter (a bias cancelled by a following norm layer): info.",
        ),
        fix="Lower the learning rate, use LeakyReLU/GELU, re-initialise the layer; drop a "
        "redundant bias (bias=False).",
        detail="every gradient of a layer exactly zero for `patience` observed steps (a single "
        "redundant parameter: `info`). An embedding with a `padding_idx` is left out (fed only "
        "that index, its gradient is zero by definition); a layer inside a third-party "
        "library's own model that never had a nonzero gradient is that model's data flow: "
        "`info`, `details.library_design` naming the package",
    )
    config: DeadParamConfig
    needs = frozenset({"samples"})

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._layers = Streaks()
        self._params = Streaks()
        self._counting: set[int] = set()  # parameters whose zero-gradient streak is > 0
        # embeddings with a padding_idx: fed only that index, torch's documented gradient is
        # exactly zero (RoCBERT's pronunciation table on text without pronunciation ids)
        self._padded: frozenset[str] = frozenset()
        self._library: dict[str, str] = {}  # library-owned module -> its package
        self._alive: set[str] = set()  # layers that had a nonzero gradient at some step
        self._samples: dict[str, int] = {}  # layer -> samples its zero streak covers

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._padded = frozenset(view.extra.get("padded_embeddings") or ())
        self._library = view.extra.get("library_owned") or {}

    def on_step(self, view: StepView, log: FindingLog) -> None:
        patience = self.config.patience
        grad_norm = view.grad_norm
        any_zero = 0.0 in grad_norm  # one C-level scan; NaN and None are not zero
        dead_layers: list[str] = []
        # samples behind each observed step (unknown: enough, as the steps alone decided)
        per_step = view.window.samples or self.config.min_samples
        table = LayerTable.of(view.layers)
        if (
            not (any_zero or self._counting or self._layers)
            and table.finite
            and 0 not in table.nonzero
        ):
            self._alive.update(table.names)  # every layer finite and alive, no streak to end
            return
        for layer, s in view.layers.items():
            finite = isfinite(s.norm)
            dead = finite and s.nonzero == 0 and layer not in self._padded
            if finite and not dead:
                self._alive.add(layer)
            covered = self._samples[layer] = self._samples.get(layer, 0) + per_step if dead else 0
            if self._layers.hit(layer, dead) >= patience and covered >= self.config.min_samples:
                dead_layers.append(layer)
                continue
            if dead or not finite:
                continue
            if not any_zero and not self._counting:
                continue  # no parameter is or was at zero: every streak would stay 0
            stuck = []
            for k in s.positions:
                i = view.ids[k]
                n = self._params.hit(i, grad_norm[k] == 0.0)
                if n:
                    self._counting.add(i)
                else:
                    self._counting.discard(i)
                if n >= patience:
                    stuck.append(i)
            if stuck:
                log.emit(
                    self.id,
                    severity="info",
                    step=view.step,
                    message=f"layer '{layer}': parameter(s) with an exactly zero gradient while "
                    "the rest of the layer learns (redundant, e.g. a bias before a norm layer).",
                    hint="Harmless but wasted: drop the parameter (bias=False) if it is redundant.",
                    params=view.index.names(stuck),
                    module=layer,
                    details={"scope": "param"},
                )
        for group in by_flow(dead_layers, view.forward):
            self._emit_layers(view, group, log)

    def _emit_layers(self, view: StepView, group: list[str], log: FindingLog) -> None:
        """One finding per dead region: a dead layer and the layers before it that get no
        gradient through it (linked by the forward's data flow) are one cause, named by the
        last of them to run (where the zeros start)."""
        stamps = view.forward.stamps
        origin = max(group, key=lambda layer: stamps.get(layer, 0))
        ids = [view.ids[k] for layer in group for k in view.layers[layer].positions]
        details: dict[str, object] = {"scope": "layer"}
        severity = self.severity
        library = {self._library.get(layer) for layer in group}
        if len(library) == 1 and None not in library and not set(group) & self._alive:
            # zero from the first step inside a library's own model: its data flow (Longformer's
            # last local q/k/v, which a classifier reading the global token never uses)
            details["library_design"] = library.pop()
            severity = "info"
        said = ""
        if len(group) > 1:
            details["layers"] = group
            said = f", and the {len(group) - 1} layer(s) before it get no gradient through it"
        log.emit(
            self.id,
            severity=severity,
            step=view.step,
            message=f"layer '{origin}': every gradient exactly zero for "
            f"{self.config.patience}+ observed steps (dead units){said}.",
            hint="Dead ReLUs or a saturated activation: lower the learning rate, use "
            "LeakyReLU/GELU, check the bias initialisation and the input scale.",
            params=view.index.names(ids),
            module=origin,
            details=details,
            key=origin,
        )
