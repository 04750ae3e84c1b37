"""Identical output units of a weight, counted on device from one projection per row.

Each row of ``W.reshape(out, -1)`` (a Linear's output unit, a conv's output channel) is
projected on one fixed random vector, in float64; equal rows give equal projections.
Different rows collide only by rounding: in float32 they did often enough to accuse a
correct layer (a default-initialised ``Linear(1024, 11008)``, a LLaMA MLP's width, showed a
false duplicate in 6 of 10 draws, ``Linear(1024, 4096)`` in 3 of 30); float64's 2**29 finer
spacing leaves that chance at about 1e-8 a weight. MPS has no float64: float32 there.
Sorting the ``out`` projections and counting equal neighbours gives how many rows repeat
another, as one device scalar per weight: no whole copy of the weights (a float64 chunk at
a time) and no host sync (read with the step's one transfer). With ``skip_zero``,
all-zero rows are not counted: after training they are equal because nothing ever updated
them (idle units: LoRA's zero-init B behind outputs the frozen base never fires), not
because they got equal updates; a layer whose every gradient is zero is ``dead_param``'s.

Example:
    >>> import torch
    >>> w = torch.ones(4, 3)
    >>> int(duplicate_rows([w])[0, 0])
    3
"""

from __future__ import annotations

import torch

__all__ = ["duplicate_rows"]

_SEED = 0x5EED


def _direction(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_SEED + n)  # the same vector for every weight of width n
    return torch.rand(n, generator=gen, dtype=torch.float64).add_(0.5).to(device, dtype)


def _project(w: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """One projection per unit (float64; float32 on MPS), ``chunk`` elements of the weight
    at a time."""
    rows = (w.movedim(dim, 0) if dim else w).reshape(w.shape[dim], -1)
    wide = torch.float32 if rows.device.type == "mps" else torch.float64
    r = _direction(rows.shape[1], rows.device, wide)
    step = max(1, chunk // max(1, rows.shape[1]))
    if step >= rows.shape[0]:
        return rows.to(wide) @ r
    return torch.cat([rows[k : k + step].to(wide) @ r for k in range(0, rows.shape[0], step)])


def duplicate_rows(
    weights: list[torch.Tensor],
    out_dims: list[int] | None = None,
    chunk: int = 1 << 22,
    *,
    skip_zero: bool = False,
) -> torch.Tensor:
    """Per weight, ``[how many of its output units equal another one, a checksum of its
    units]`` (a ``(len(weights), 2)`` float tensor; the checksum tells a weight that did not
    move between two looks).

    ``out_dims[k]``: the dimension of ``weights[k]`` that indexes its units (0 for
    ``nn.Linear`` and convolutions; 1 for Hugging Face's ``Conv1D``). A low-precision weight
    is widened ``chunk`` elements at a time (a bounded transient, never a whole copy).
    ``skip_zero``: all-zero units are not counted (see the module docstring).
    """
    counts = []
    with torch.no_grad():
        for k, w in enumerate(weights):
            dim = out_dims[k] if out_dims is not None else 0
            proj = _project(w, dim, chunk)
            s = proj.sort().values
            same = s[1:] == s[:-1]
            if skip_zero:
                same &= s[1:] != 0
            counts.append(torch.stack([same.sum().float(), proj.sum().float()]))
    if not counts:
        return torch.zeros(0, 2)
    devices = {c.device for c in counts}
    device = counts[0].device if len(devices) == 1 else torch.device("cpu")
    return torch.stack([c.to(device) for c in counts])
