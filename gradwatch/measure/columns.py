"""Per-layer statistics as columns, reduced on the device before the step's one transfer.

A step with every statistic reads, per parameter, the gradient's L2 norm, L1 sum, max |g| and
non-zero count, the parameter's norm and the update's norm. Folding those into per-layer values
in Python costs a few microseconds per layer (200 layers: about half a millisecond a step);
here each statistic is one column and the whole fold is a handful of kernels whatever the
number of layers (``index_add_`` and ``scatter_reduce_`` over the parameters' layer indices).

The host gets six values per layer, in this order: grad norm, parameter norm, update norm
(NaN where a parameter's update is unknown, or all NaN without a fingerprint), sum |g|,
non-zero count, max |g|. Sums of squares are taken in float64 so a layer's norm overflows no
sooner than its parameters' own; NaN and Inf propagate (callers fall back to the exact
per-parameter fold when a norm is not finite).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ROWS", "Layout", "fold", "layout"]

ROWS = 6  # values per layer in the folded vector (see the module docstring)

_F64 = torch.float64


class Layout:
    """One grouping of parameter positions into layers, with its index tensor per device."""

    __slots__ = ("_numel", "_on", "_sizes", "groups", "names", "positions")

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.names = list(groups)
        self.positions = list(groups.values())
        self._on: dict[torch.device, torch.Tensor] = {}
        self._numel: list[int] = []
        self._sizes: list[int] = []

    def on(self, device: torch.device) -> torch.Tensor:
        """The layer (row) of each position, on ``device``."""
        found = self._on.get(device)
        if found is None:
            index = [0] * sum(map(len, self.positions))
            for row, js in enumerate(self.positions):
                for j in js:
                    index[j] = row
            found = self._on[device] = torch.tensor(index, dtype=torch.int64, device=device)
        return found

    def sizes(self, numel: list[int]) -> list[int]:
        """Each layer's element count (at least 1) for the positions' ``numel``."""
        if numel != self._numel:
            self._sizes = [sum(numel[j] for j in js) or 1 for js in self.positions]
            self._numel = list(numel)
        return self._sizes


_LAYOUTS: dict[int, Layout] = {}


def layout(groups: dict[str, list[int]]) -> Layout:
    """The :class:`Layout` of ``groups`` (a track's own dict: cached by its identity)."""
    found = _LAYOUTS.get(id(groups))
    if found is None or found.groups is not groups:
        if len(_LAYOUTS) > 64:  # bounded: a few layouts per process
            _LAYOUTS.clear()
        found = _LAYOUTS[id(groups)] = Layout(groups)
    return found


def fold(
    lay: Layout,
    norm: torch.Tensor,
    l1: torch.Tensor,
    linf: torch.Tensor,
    nnz: torch.Tensor,
    param_norm: torch.Tensor,
    delta: Optional[torch.Tensor],
) -> torch.Tensor:
    """The per-layer values of per-position vectors (all on one device), as one vector.

    Example:
        >>> lay = layout({"a": [0, 1], "b": [2]})
        >>> v = torch.tensor([3.0, 4.0, 1.0])
        >>> fold(lay, v, v, v, v, v, None).view(ROWS, -1)[0].tolist()
        [5.0, 1.0]
    """
    index = lay.on(norm.device)
    no_delta = delta is None
    d = norm.new_zeros(norm.shape) if delta is None else delta
    cols = torch.stack([norm, param_norm, d, l1, nnz]).to(_F64)
    cols[:3].square_()
    sums = cols.new_zeros(5, len(lay.names)).index_add_(1, index, cols)
    sums[:3].sqrt_()
    if no_delta:
        sums[2].fill_(float("nan"))
    top = linf.new_zeros(len(lay.names)).scatter_reduce_(0, index, linf, "amax")
    return torch.cat([sums.view(-1), top.to(_F64)])
