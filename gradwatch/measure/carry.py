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

**Judged by the samples alone.** A tensor whose sampled values moved at each of its measured
steps (a dense update: SGD's, Adam's) takes no checksum at all, neither after the step nor
before the next: a moved sampled value already proves the change, and the checksum's only
use is to tell "unchanged" from "changed where no sample looked". On 8 x Linear(2048, 2048)
with every statistic every step, that integer sum cost about 3 ms of a step (issue 49). The
first step on which no sampled value of such a tensor moves is reported as unknown (NaN),
never as unchanged, and its checksum is read before the next step; from then on it is
always taken (:func:`still`: a sparse update, an embedding's rows, may move no sampled
value). Off under ``torch.distributed``, where the replicas' check compares the ranks'
pre-step checksums.

Such a tensor's sample before the step is the one kept after the last step, checked against
one sampled value in :data:`PROBE` (about one value in 8,144) and the version counter: a
gather of 8K scattered values costs about 0.1 ms a tensor, its sixteenth nearly nothing. A
write through ``.data`` between the steps that moves no probed value is then counted in the
next step's update (the samples before it are the kept ones); it cannot make a tensor look
unchanged, only changed by more.

CPU tensors only: the decision reads the sample checksums on the host, which on a CPU
waits for nothing; on an accelerator the two reads stay (they cost less there).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["Taken", "ambiguous", "forget", "remember", "take"]

PROBE = 16  # a tensor judged by its samples: one sampled value in PROBE read before the step


class _Kept(NamedTuple):
    """What an after-step reading leaves for the next fingerprint of one tensor."""

    ref: Any  # a weak reference to the tensor
    version: int
    key: tuple[int, int, int]  # its sample's (offset, stride, count)
    checksum: Optional[torch.Tensor]  # 1-element int64; None: none taken (judged by samples)
    sample_sum: int  # the sample's bit patterns summed
    moving: bool  # a sampled value moved at each of its measured steps
    sample: torch.Tensor  # the sampled values after the step (float32, a copy)


_CARRY: dict[int, _Kept] = {}  # id(tensor) -> its reading
# id(tensor) -> weak reference: a sampled value of it stood still on a measured step, so its
# checksum is always taken (a sparse update may move no sampled value)
_STILL: dict[int, Any] = {}
_MAX = 4096  # entries: the large tensors of a few models


@dataclass
class Taken:
    """Per tensor: the carried checksum (None: read it, unless judged by its samples), whether
    this step's change is judged by its samples alone (no checksum before or after), and its
    sample before the step."""

    checksums: list[Optional[torch.Tensor]]
    by_samples: list[bool]
    samples: list[torch.Tensor] = field(default_factory=list)


def _sample_sums(
    samples: Sequence[torch.Tensor], moved: Optional[torch.Tensor] = None
) -> tuple[list[int], list[bool]]:
    """Each float32 sample's bit patterns summed, and where ``moved`` is non-zero: one host
    read for both."""
    parts = [s.view(torch.int32).sum(dtype=torch.int64).reshape(1) for s in samples]
    if moved is not None:
        parts.append((moved.to("cpu") > 0).to(torch.int64).reshape(-1))
    values = torch.cat(parts).tolist() if parts else []
    n = len(samples)
    return values[:n], [v > 0 for v in values[n:]]


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
    checksums: Sequence[Optional[torch.Tensor]],
    samples: Sequence[torch.Tensor],
    moved: torch.Tensor,
) -> None:
    """Keep the checksums just read after a step, for the next :func:`take`.

    ``keys``: each tensor's sample (offset, stride, count); ``samples``: those values, float32;
    ``checksums``: 1-element int64, None where none was taken (the next fingerprint reads it,
    unless the tensor is judged by its samples); ``moved``: per tensor, non-zero where a
    sampled value moved in the step.
    """
    if not tensors or not _on_cpu(tensors):
        return
    if len(_CARRY) > _MAX:  # bounded; a miss only costs a read
        _CARRY.clear()
    if len(_STILL) > _MAX:  # a tensor dropped here is judged by its samples again
        _STILL.clear()
    sums, went = _sample_sums(samples, moved)
    for t, key, c, s, m, sample in zip(tensors, keys, checksums, sums, went, samples):
        version = _version(t)
        if version is None:
            continue
        try:
            ref = weakref.ref(t)
        except TypeError:  # a tensor type without weak references: no carry
            continue
        if not m:
            _STILL[id(t)] = ref
        _CARRY[id(t)] = _Kept(ref, version, key, c, s, m and not still(t), sample)


def still(t: torch.Tensor) -> bool:
    """Whether a sampled value of ``t`` stood still on a measured step (see the docstring)."""
    ref = _STILL.get(id(t))
    return ref is not None and ref() is t


def take(
    tensors: Sequence[torch.Tensor],
    keys: Sequence[tuple[int, int, int]],
    gather: Callable[[int], torch.Tensor],
) -> Taken:
    """Per tensor, what the last after-step reading carries to this fingerprint.

    ``gather(k)``: tensor ``k``'s sample read now (float32, a copy). It is compared with the
    one kept: where they differ, or the version counter moved, nothing is carried (read it).
    A tensor judged by its samples is compared on one sampled value in :data:`PROBE` and,
    where those are equal, its kept sample stands for the one before the step (see the
    module docstring).
    """
    n = len(tensors)
    out = Taken([None] * n, [False] * n)
    found: list[Optional[torch.Tensor]] = [None] * n
    checked: list[tuple[int, _Kept]] = []
    alone = bool(_CARRY) and not (dist.is_available() and dist.is_initialized())
    for k, (t, key) in enumerate(zip(tensors, keys) if _CARRY and _on_cpu(tensors) else ()):
        kept = _CARRY.pop(id(t), None)  # one use: the after-reading renews it
        if kept is None or kept.ref() is not t or kept.version != _version(t) or kept.key != key:
            continue
        if not (alone and kept.moving):
            checked.append((k, kept))
        elif _probe(t, key, kept.sample):
            found[k], out.by_samples[k], out.checksums[k] = kept.sample, True, kept.checksum
    out.samples = [s if s is not None else gather(k) for k, s in enumerate(found)]
    if checked:
        sums, _ = _sample_sums([out.samples[k] for k, _ in checked])
        for (k, kept), s in zip(checked, sums):
            if s == kept.sample_sum:  # a None checksum: read it
                out.checksums[k] = kept.checksum
    return out


def _probe(t: torch.Tensor, key: tuple[int, int, int], sample: torch.Tensor) -> bool:
    """Whether one sampled value of ``t`` in :data:`PROBE` still equals the kept ``sample``'s."""
    offset, stride, count = key
    flat = t.detach().reshape(-1)
    now = flat[offset : offset + (count - 1) * stride + 1 : stride * PROBE]
    return torch.equal(now.to(torch.float32), sample[::PROBE])


def forget() -> None:
    """Drop every carried checksum (the next fingerprints read their tensors)."""
    _CARRY.clear()
    _STILL.clear()


def ambiguous(
    carried: torch.Tensor, checksum_changed: torch.Tensor, moved: torch.Tensor
) -> torch.Tensor:
    """Where a carried checksum changed but no sampled value moved (see the module docstring)."""
    return carried & checksum_changed & (moved == 0)
