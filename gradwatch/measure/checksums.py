"""Exact bit checksums of whole tensors, as plain ints (for checkpoints and cross-rank checks).

A tensor's checksum is the sum of its values' bit patterns modulo 2**32, the same rule as
:mod:`gradwatch.measure.fingerprint`: a change of any single element changes it. The sums
stay on the device until one host transfer for the whole list.

Example:
    >>> import torch
    >>> a = torch.ones(4)
    >>> checksums([a]) == checksums([a.clone()]), checksums([a]) == checksums([a * 2])
    (True, False)
"""

from __future__ import annotations

import torch

__all__ = ["checksum_tensors", "checksums"]

_MASK = (1 << 32) - 1


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t  # type: ignore[no-any-return]


def checksum_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bit-pattern sum as a 0-dim int64 tensor on its device (no host sync)."""
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for t in tensors:
            t = _local(t).detach()
            if t.is_complex():
                t = torch.view_as_real(t)
            if t.is_floating_point() and t.element_size() == 2:
                t = t.to(torch.float32)
            elif t.dtype == torch.bool:
                t = t.to(torch.int32)
            if t.is_floating_point():
                t = t.contiguous().view(torch.int64 if t.element_size() == 8 else torch.int32)
            out.append(
                t.sum(dtype=torch.int64) if t.numel() else torch.zeros((), dtype=torch.int64)
            )
    return out


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's exact checksum (0 <= value < 2**32), with one host transfer per device."""
    sums = checksum_tensors(tensors)
    if not sums:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for k, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(k)
    out = [0] * len(sums)
    for positions in by_device.values():
        values = torch.stack([sums[k] for k in positions]).cpu().tolist()
        for k, v in zip(positions, values):
            out[k] = int(v) & _MASK
    return out
