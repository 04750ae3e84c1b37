"""Whether gradients were reset since the last step, for parameters whose hook was trimmed.

After ``trim_hooks_after`` steps most parameters lose their value-check (pre-accumulation)
hook. A ``zero_grad()`` forgotten once, late in the run, must still be seen: at the first
gradient arrival of each backward pass (before the others accumulate) this looks at the
parameters still holding the gradient their optimizer's last step left, untouched (same
tensor, same version): only its values can tell a reset by ``.data.zero_()`` from none.
The check is a device-side 0-dim flag, resolved at the step (no sync here).

Cost: a forgotten ``zero_grad()`` leaves every gradient of its optimizer untouched, so a
spread sample of each optimizer's parameters (``SAMPLE``) is looked at first, and all of
them only when one of the sample is untouched. A loop that resets with ``set_to_none``
(the default) or ``zero_()`` reads ``p.grad`` of the sample only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Track

__all__ = ["sweep_resets"]

SAMPLE = 16  # parameters looked at per optimizer before deciding to look at all


def _untouched(t: Tracker, i: int, g: torch.Tensor) -> bool:
    """``g`` is what the step left (same tensor, same version), or a view (shared counter)."""
    return g._base is not None or (t.snap_ref[i]() is g and g._version == t.snap_ver[i])


def sweep_resets(tracker: Tracker, tracks: Sequence[Track]) -> None:
    """Flag, as pending value checks, gradients not reset since their optimizer's step."""
    t = tracker
    fresh, has_pre, pending = t.fresh, t.has_pre, t.pending
    leader = t.leader
    if leader >= 0 and not has_pre[leader]:
        # The parameter whose arrival called this accumulated already: its value check
        # comes back at the next step (it leads the next backward passes too).
        t.want_pre.add(leader)
    if pending:
        # Flags raised at an earlier backward's start are void once reset (a GAN's G).
        params = {i: p for track in tracks for i, p in zip(track.ids, track.params)}
        for i in list(pending):
            p = params.get(i)
            if p is None or not fresh[i] or has_pre[i]:
                continue
            g = p.grad
            if g is None or not _untouched(t, i, g):
                t.dirty[i] = False
                pending.discard(i)
    for track in tracks:
        if track.index is None or not track.ids:
            continue  # without an optimizer nothing consumes a gradient twice
        n = len(track.ids)
        stride = max(1, n // SAMPLE)
        sample = range(0, n, stride)
        ids, ps = track.ids, track.params
        if not any(
            fresh[ids[k]]
            and not has_pre[ids[k]]
            and (g := ps[k].grad) is not None
            and _untouched(t, ids[k], g)
            for k in sample
        ):
            continue
        for i, p in zip(ids, ps):
            if not fresh[i] or has_pre[i]:
                continue
            g = p.grad
            if g is not None and _untouched(t, i, g):
                t.dirty[i] = torch.ne(g.detach(), 0).any()
                pending.add(i)
