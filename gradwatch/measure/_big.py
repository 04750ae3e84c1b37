"""What a step changed in the large tensors: their checksums and samples, in one batch.

:func:`~gradwatch.measure.fingerprint.measure` hands the large tensors of a plan here after
a step, with what their fingerprint held before it. The samples of all of them are compared
at once, by ``foreach`` kernels over the list: per tensor, the dozen small kernels of a
comparison cost more than reading its checksum (issue 49). The differences are taken in
place in the fingerprint's samples, which are then spent: a fingerprint is measured once.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gradwatch.measure import carry
from gradwatch.measure._fingerprint_plan import Plan
from gradwatch.measure._reads import big_values, sample_key

__all__ = ["Before", "big_changes"]

_F32 = torch.float32
Fused = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


class Before(NamedTuple):
    """The large tensors' part of a fingerprint (see ``fingerprint.Fingerprint``)."""

    checksums: list[torch.Tensor]
    samples: list[torch.Tensor]
    carried: Optional[torch.Tensor]
    by_samples: Optional[list[bool]]


def big_changes(
    tensors: list[torch.Tensor], plan: Plan, before: Before, fused: Optional[Fused]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(changed, update-norm estimate, moved share) of the large tensors, each a vector.

    ``fused``: the norms, checksums and samples already read after the step
    (:func:`~gradwatch.measure.chunked.norms_and_checksums`); None: read them here.
    """
    if fused is not None:  # the samples were taken during that read
        values = [(fused[1][i : i + 1], fused[2][i]) for i in range(len(plan.big))]
    else:
        values = [big_values(tensors[b.position], b) for b in plan.big]
    olds, sums = before.samples, before.checksums
    if not plan.single_device:  # model parallel: the small results on one device
        values = [(c.to(plan.device), s.to(plan.device)) for c, s in values]
        olds = [x.to(plan.device) for x in olds]
        sums = [x.to(plan.device) for x in sums]
    # The samples' differences, taken in place in the samples before the step: the
    # fingerprint's own copies, read once (``measure``). A copy of the samples is a fifth of
    # a percent of the weights (STRIDE), and it was the step's largest temporary (issue 49:
    # gradwatch's memory at most 1 % of the weights). The sign does not matter below.
    torch._foreach_sub_(olds, [s for _, s in values])
    c = torch.cat([c for c, _ in values]) != torch.cat(sums)
    alone = before.by_samples
    blind = torch.tensor(alone, device=c.device) if alone is not None else None
    if blind is not None:  # no checksum: a moved sampled value is the change, else unknown
        c = c.masked_fill_(blind, False)
    scales, counts = _layout(plan)
    frac = torch.stack(torch._foreach_norm(olds, 0)).div_(counts)  # NaN counts as moved
    moved = (frac > 0).to(_F32)
    est = torch.stack(torch._foreach_norm(olds, 2)).square_()
    changed, delta = (c.to(_F32) + moved).clamp_(max=1), (est * scales).sqrt_()
    unknowns = [] if before.carried is None else [carry.ambiguous(before.carried, c, moved)]
    if blind is not None:
        unknowns.append(blind & (moved == 0))
    for unknown in unknowns:  # a carried checksum never says "changed" on its own
        changed = changed.masked_fill_(unknown, float("nan"))
        delta = delta.masked_fill_(unknown, float("nan"))
    if fused is not None:  # the next step's fingerprint may reuse these checksums
        _remember(tensors, plan, fused[1], [s for _, s in values], moved, alone)
    return changed, delta, frac


def _remember(
    tensors: list[torch.Tensor],
    plan: Plan,
    sums: torch.Tensor,
    samples: list[torch.Tensor],
    moved: torch.Tensor,
    alone: Optional[list[bool]],
) -> None:
    """Carry the after-step checksums to the next fingerprint (:mod:`carry`); none for a
    tensor judged by its samples (one that moved none is read before the next step)."""
    kept: list[Optional[torch.Tensor]] = [
        None if alone and alone[i] else sums[i : i + 1] for i in range(len(plan.big))
    ]
    bigs = [tensors[b.position] for b in plan.big]
    carry.remember(bigs, [sample_key(b) for b in plan.big], kept, samples, moved)


_LAYOUTS: dict[int, tuple[Plan, torch.Tensor, torch.Tensor]] = {}


def _layout(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(each large tensor's scale, its sample count) as float32 vectors on the plan's device,
    cached per plan."""
    found = _LAYOUTS.get(id(plan))
    if found is None or found[0] is not plan:
        if len(_LAYOUTS) > 64:  # bounded: plans are cached per layout, a few per process
            _LAYOUTS.clear()
        scales = torch.tensor([b.scale for b in plan.big], dtype=_F32, device=plan.device)
        counts = torch.tensor([b.m for b in plan.big], dtype=_F32, device=plan.device)
        found = _LAYOUTS[id(plan)] = (plan, scales, counts)
    return found[1], found[2]
