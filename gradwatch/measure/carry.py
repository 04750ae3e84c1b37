"""A large CPU tensor's checksum, carried from one step's after-reading to the next before.

With statistics on every step, ``measure`` reads each large parameter after a step (its
norm and checksum in one pass) and ``fingerprint`` read it again before the next step, for
the same checksum, when nothing had written the tensor in between. On 8 x Linear(2048,
2048) that second read was a fifth of gradwatch's added time (issue 49).

The before-reading now reuses the after-reading's checksum when both of these hold:

- the tensor's version counter is unchanged: an in-place write through the tensor
  (``copy_``, ``load_state_dict``, a foreach or for-loop optimizer's step) bumps it;
- its sampled values are, bit for bit, those sampled after the step (a checksum of the
  sample compares them). This catches the writes the counter misses, an edit through
  ``.data`` and a fused optimizer's step (``Adam(fused=True)`` bumps no counter, checked),
  wherever they change a sampled value (about one value in 509 of a large tensor).

A write of unsampled values only leaves the carried checksum stale, and the comparison
after the step cannot then tell that write from the step. So a carried
checksum is trusted to say "unchanged", but "changed, and no sampled value moved" becomes
"unknown" (:func:`ambiguous`), never "changed": a frozen parameter is not accused on a
carried checksum, and the stale check loses at most that step's evidence.

CPU tensors only: the decision reads the sample checksums on the host, which on a CPU
waits for nothing; on an accelerator the two reads stay (they cost less there).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Optional

import torch

__all__ = ["ambiguous", "forget", "remember", "take"]

# id(tensor) -> (weak reference, version, sample key, checksum (1-element int64), sample sum)
_CARRY: dict[int, tuple[Any, int, tuple[int, int, int], torch.Tensor, int]] = {}
_MAX = 4096  # entries: the large tensors of a few models


def _sample_sums(samples: Sequence[torch.Tensor]) -> list[int]:
    """Each float32 sample's bit patterns summed (one host read for the list)."""
    sums = [s.view(torch.int32).sum(dtype=torch.int64) for s in samples]
    return torch.stack(sums).tolist()


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter: no carry
        return None


def _on_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def remember(
    tensors: Sequence[torch.Tensor],
    keys: Sequence[tuple[int, int, int]],
    checksums: torch.Tensor,
    samples: Sequence[torch.Tensor],
) -> None:
    """Keep the checksums just read after a step, for the next :func:`take`.

    ``keys``: each tensor's sample (offset, stride, count); ``samples``: those values, float32.
    """
    if not tensors or not _on_cpu(tensors):
        return
    if len(_CARRY) > _MAX:  # bounded; a miss only costs a read
        _CARRY.clear()
    sums = _sample_sums(samples)
    for k, (t, key, s) in enumerate(zip(tensors, keys, sums)):
        version = _version(t)
        if version is None:
            continue
        try:
            ref = weakref.ref(t)
        except TypeError:  # a tensor type without weak references: no carry
            continue
        _CARRY[id(t)] = (ref, version, key, checksums[k : k + 1], s)


def take(
    tensors: Sequence[torch.Tensor],
    keys: Sequence[tuple[int, int, int]],
    samples: Sequence[torch.Tensor],
) -> list[Optional[torch.Tensor]]:
    """Per tensor, the checksum carried from the last after-step reading, or None (read it).

    ``samples``: each tensor's sample taken now (float32), compared with the one kept.
    """
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    if not _CARRY or not _on_cpu(tensors):
        return out
    candidates: list[int] = []
    kept: list[tuple[Any, int, tuple[int, int, int], torch.Tensor, int]] = []
    for k, (t, key) in enumerate(zip(tensors, keys)):
        entry = _CARRY.pop(id(t), None)  # one use: the after-reading renews it
        if entry is not None and entry[0]() is t and entry[1] == _version(t) and entry[2] == key:
            candidates.append(k)
            kept.append(entry)
    if candidates:
        sums = _sample_sums([samples[k] for k in candidates])
        for k, entry, s in zip(candidates, kept, sums):
            if s == entry[4]:
                out[k] = entry[3]
    return out


def forget() -> None:
    """Drop every carried checksum (the next fingerprints read their tensors)."""
    _CARRY.clear()


def ambiguous(
    carried: torch.Tensor, checksum_changed: torch.Tensor, moved: torch.Tensor
) -> torch.Tensor:
    """Where a carried checksum changed but no sampled value moved (see the module docstring)."""
    return carried & checksum_changed & (moved == 0)
