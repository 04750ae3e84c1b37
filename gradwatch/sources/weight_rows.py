"""``weight_rows``: identical output units of each trainable weight at the first steps.

A Linear's rows, a convolution's output channels (a Hugging Face ``Conv1D``'s columns) are
the layer's units. After the first optimizer step and again after step ``L`` (the setting,
3 by default), each weight's units are compared by one projection per unit
(:func:`gradwatch.measure.rows.duplicate_rows`): one device scalar per weight, read with
the step's one transfer; no copy of the weights, nothing on the other steps. Units equal
both times have stayed equal under training (constant or zero init feeding tanh/sigmoid);
a zero head or a zero-init residual branch is broken by its first update and is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from gradwatch.capture.grads.window import Track
from gradwatch.measure.rows import duplicate_rows
from gradwatch.sources.base import EvidenceSource, SourceContext, StepState

__all__ = ["RowLooks", "WeightRowsSource"]

_CHUNK = 1 << 22  # elements projected at once: a bounded transient of a large weight


@dataclass
class RowLooks:
    """Per weight name: its units and how many repeat another, after step 0 and step L."""

    units: dict[str, int] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)
    later: dict[str, int] = field(default_factory=dict)
    moved: dict[str, bool] = field(default_factory=dict)  # it changed between the two looks
    _sums: dict[str, float] = field(default_factory=dict)
    later_step: int = 3
    done: bool = False  # both looks taken (for every watched optimizer)


def _unit_dim(mod: nn.Module) -> Optional[int]:
    """The dimension of ``mod.weight`` that indexes its units (``None``: not judged)."""
    if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)) and not isinstance(
        mod, nn.modules.conv._ConvTransposeNd
    ):
        return 0
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):  # Hugging Face GPT-2's
        return 1
    return None


class WeightRowsSource(EvidenceSource):
    name = "weight_rows"
    serves = frozenset({"weight_rows"})

    def __init__(self, ctx: SourceContext, wanted: dict[str, Any]) -> None:
        super().__init__(ctx, wanted)
        later = wanted.get("weight_rows", 3)
        self.looks = RowLooks(later_step=later if isinstance(later, int) and later > 0 else 3)
        self._weights: dict[int, tuple[str, int]] = {}  # id(weight) -> (name, unit dim)
        self._pending: list[str] = []
        self._looked: dict[Optional[int], int] = {}  # optimizer -> looks taken

    def install(self) -> None:
        ctx = self.ctx
        if ctx.model is None or ctx.sharded is not None:
            return
        index = ctx.structure.index
        for mod in ctx.model.modules():
            dim = _unit_dim(mod)
            if dim is None or parametrize.is_parametrized(mod, "weight"):
                continue  # reading a parametrized weight computes it (spectral norm's step)
            w = mod._parameters.get("weight")
            if dim is None or not isinstance(w, nn.Parameter):
                continue
            i = index.lookup(w)
            if i is None or isinstance(w, nn.parameter.UninitializedParameter) or w.dim() < 2:
                continue
            if w.shape[dim] >= 2 and w.is_floating_point():
                self._weights[id(w)] = (index.params[i].name, dim)

    def _due(self, track: Track) -> Optional[str]:
        if track.steps == 0:
            return "first"
        if track.steps == self.looks.later_step:
            return "later"
        return None

    def device_values(self, track: Track) -> list[torch.Tensor]:
        self._pending = []
        if self._due(track) is None or not self._weights:
            return []
        weights, dims = [], []
        for p in track.params:
            entry = self._weights.get(id(p))
            if entry is not None and p.requires_grad:
                weights.append(p)
                dims.append(entry[1])
                self._pending.append(entry[0])
                self.looks.units[entry[0]] = p.shape[entry[1]]
        if not weights:
            return []
        # Later, units still all zero were never updated: idle, not symmetric (skip_zero).
        later = self._due(track) == "later"
        return [duplicate_rows(weights, dims, chunk=_CHUNK, skip_zero=later)]

    def read(self, state: StepState, values: list[float]) -> None:
        track = state.track
        if track is None or not self._pending or len(values) != 2 * len(self._pending):
            return
        due = self._due(track)
        looks = self.looks
        into = looks.first if due == "first" else looks.later
        for n, name in enumerate(self._pending):
            dups, total = int(values[2 * n]), values[2 * n + 1]
            into[name] = dups
            if due == "first":
                looks._sums[name] = total
            else:  # unmoved (a skipped step, lr 0, no gradient): no evidence either way
                looks.moved[name] = total != looks._sums.get(name, total)
        self._looked[track.index] = self._looked.get(track.index, 0) + 1
        if due == "later":
            self.looks.done = True

    def record(self, state: StepState) -> Optional[RowLooks]:
        return self.looks if self.looks.units else None
