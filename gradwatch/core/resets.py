"""Whether gradients were reset since the last step, for parameters whose hook was trimmed.

After ``trim_hooks_after`` steps most parameters lose their value-check (pre-accumulation)
hook. A ``zero_grad()`` forgotten once, late in the run, must still be seen: at the first
gradient arrival of each backward pass (before the others accumulate) this looks once at
every parameter still holding the gradient its optimizer's last step left, untouched (same
tensor, same version): only its values can tell a reset by ``.data.zero_()`` from none.
The check is a device-side 0-dim flag, resolved at the step (no sync here). Loops that reset
with ``set_to_none`` (the default) or ``zero_()`` cost one ``p.grad`` read per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradwatch.core.evidence import Tracker
from gradwatch.core.pipeline import Track

__all__ = ["sweep_resets"]


def sweep_resets(tracker: Tracker, tracks: Sequence[Track]) -> None:
    """Flag, as pending value checks, gradients not reset since their optimizer's step."""
    t = tracker
    fresh, has_pre, sref, sver = t.fresh, t.has_pre, t.snap_ref, t.snap_ver
    leader, pending = t.leader, t.pending
    if leader >= 0 and not has_pre[leader]:
        # The parameter whose arrival called this accumulated already: its value check
        # comes back at the next step (it leads the next backward passes too).
        t.want_pre.add(leader)
    for track in tracks:
        if track.index is None:
            continue  # without an optimizer nothing consumes a gradient twice
        for i, p in zip(track.ids, track.params):
            if not fresh[i] or has_pre[i]:
                continue
            g = p.grad
            if g is None or (g._base is None and (sref[i]() is not g or g._version != sver[i])):
                if i in pending:  # reset since an earlier backward's look (a GAN's G)
                    t.dirty[i] = False
                    pending.discard(i)
                continue
            t.dirty[i] = torch.ne(g.detach(), 0).any()
            pending.add(i)
