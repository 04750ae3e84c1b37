"""Copy-free per-sample fingerprints and column scales of a batch as fed.

``sample_prints(x)``: one int64 per sample (dim 0), computed on the tensor's device from a
fixed strided subset of at most ``COLS`` of its elements per sample: a weighted sum in
float64 of those elements, viewed as its bit pattern. Equal samples give equal prints (the
same elements, the same weights, the same summation order); different samples collide only
if they agree on every sampled element and the sums agree to the bit. Nothing of the data
is kept: ``n`` integers per batch.

``column_scales(x)``: for a float 2-D ``(n, f)`` batch, each feature's standard deviation
and the batch's largest magnitude: the evidence that features differ in scale.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["COLS", "column_scales", "sample_prints", "value_range"]

COLS = 64  # elements read per sample


def _weights(m: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0x5EED + m)
    return (torch.rand(m, generator=g, dtype=torch.float64) + 0.5).to(device)


def sample_prints(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``(n,)`` int64 prints of the samples of ``x`` (``None``: not a batch of samples)."""
    if x.dim() == 0 or x.shape[0] == 0 or x.is_complex() or x.dtype == torch.bool:
        return None
    flat = x.detach().reshape(x.shape[0], -1)
    m = flat.shape[1]
    if m == 0:
        return None
    stride = max(1, m // COLS)
    sub = flat[:, ::stride][:, :COLS].to(torch.float64)
    w = _weights(sub.shape[1], sub.device)
    return (sub * w).sum(1).view(torch.int64)


def column_scales(x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per-feature std ``(f,)`` and the largest magnitude of a float ``(n, f)`` batch."""
    if x.dim() != 2 or not x.is_floating_point() or x.shape[0] < 2 or x.shape[1] < 2:
        return None
    v = x.detach().float()
    return v.std(0), v.abs().max()


def value_range(x: torch.Tensor, m: int = 4096) -> Optional[torch.Tensor]:
    """``(min, max, share of integral values)`` of a strided subset of a float tensor."""
    if not x.is_floating_point() or x.numel() == 0:
        return None
    flat = x.detach().reshape(-1)
    v = flat[:: max(1, flat.numel() // m)].float()
    return torch.stack([v.min(), v.max(), (v == v.round()).float().mean()])
