"""The small tensors' after-step reading, carried to the next step's fingerprint.

With statistics on every step, :func:`~gradwatch.measure.fingerprint.measure` stacks each
group of small tensors after a step (their norms, checksums and samples) and
:func:`~gradwatch.measure.fingerprint.fingerprint` stacked them again before the next step,
for the same checksums and samples when nothing had written them in between. On 200 x
Linear(16, 16) the second stack was about 0.2 ms of a step (issue 49). Here the
before-reading of the very next step reuses the after-reading when:

- it is the same list of tensors and the step right after the one measured (a step
  counter the caller passes: a step that was not measured in between voids the carry, so a
  fused optimizer's step, which bumps no version counter, is never missed);
- every tensor's version counter is unchanged: an in-place write through the tensor
  (``copy_``, ``load_state_dict``, a foreach or for-loop optimizer's step, a ``no_grad``
  edit) bumps it.

What no counter sees is a write through ``.data`` (or ``vector_to_parameters``) between
two steps: with the carry it is measured as part of the next step's update (it did move the
tensor since the last reading). Frozen parameters are never carried (their fingerprint
judges a move by the step alone), nor are large tensors (:mod:`gradwatch.measure.carry`
checks theirs against a sample).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

__all__ = ["forget", "remember", "take"]

_version = attrgetter("_version")
# tensors' ids -> (plan, versions, the step it is for, checksums, samples) per group
_AFTER: dict[tuple[int, ...], tuple[Any, list[int], int, list[torch.Tensor], list[torch.Tensor]]]
_AFTER = {}
_MAX = 16  # entries: a few tracked lists per process


def _versions(tensors: list[torch.Tensor]) -> Optional[list[int]]:
    try:
        return list(map(_version, tensors))
    except RuntimeError:  # an inference tensor keeps no version counter: no carry
        return None


def remember(
    key: tuple[int, ...],
    tensors: list[torch.Tensor],
    plan: Any,
    step: int,
    checksums: list[torch.Tensor],
    samples: list[torch.Tensor],
) -> None:
    """Keep the groups' after-step ``checksums`` and ``samples`` of ``tensors`` for the
    fingerprint before ``step`` (the next one)."""
    versions = _versions(tensors)
    if versions is None:
        return
    if len(_AFTER) >= _MAX and key not in _AFTER:
        _AFTER.clear()
    _AFTER[key] = (plan, versions, step, checksums, samples)


def take(
    key: tuple[int, ...], tensors: list[torch.Tensor], step: int
) -> Optional[tuple[Any, list[torch.Tensor], list[torch.Tensor]]]:
    """(plan, checksums, samples) kept for ``step`` of these tensors, or None (read them).

    One use: the next after-reading renews it.
    """
    entry = _AFTER.pop(key, None)
    if entry is None or entry[2] != step or _versions(tensors) != entry[1]:
        return None
    return entry[0], list(entry[3]), list(entry[4])


def forget() -> None:
    """Drop every carried reading (the next fingerprints read their tensors)."""
    _AFTER.clear()
