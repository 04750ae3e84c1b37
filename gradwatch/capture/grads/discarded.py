"""Micro-batches whose gradients were reset before the step that should have used them.

``zero_grad()`` inside a gradient-accumulation loop leaves the step only the last
micro-batch's gradient. The post-accumulate hook counts each reset (``set_to_none``: a new
``.grad`` tensor) between two backward passes of one window (``Tracker.dropped``); this reads
the count at the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Track

__all__ = ["discarded_passes"]


def discarded_passes(
    tracker: Tracker,
    track: Track,
    tracks: Sequence[Track],
    exact: bool = True,
    batches: Optional[int] = None,
) -> int:
    """Backward passes of this window whose gradients were reset before the step used them
    (``Tracker.dropped``), where the step's ``.grad`` is still what the last one left: a
    gradient rewritten since (PCGrad's merge) was made from all of them. Under DDP
    (``exact=False``) the reducer writes the averaged gradient in place after the last
    accumulation: the tensor's identity is compared, not its version. Not judged while
    another optimizer whose parameters get gradients has never stepped: the dropped
    gradient was its loss's (a GAN's generator step forgotten: ``stale_param``).

    ``batches``: the batches the model's forward began in this window (the forward scout's
    count, ``None`` where unknown). A micro-batch is only discarded when a later batch
    followed it: a backward of the same forward reset on purpose (a gradient monitor's
    ``backward(retain_graph=True)``, its norms read, ``zero_grad()``, the real backward) is
    no discarded micro-batch, so at most ``batches - 1`` passes are."""
    t = tracker
    if not t.dropping or any(
        o is not track and o.index is not None and o.steps == 0 and _received(t, o) for o in tracks
    ):
        return 0
    worst = 0
    for i, p in zip(track.ids, track.params):
        if i in t.dropping:
            g = p.grad
            if g is not None and g._base is None and t.acc_ref[i]() is g:
                if not exact or g._version == t.acc_ver[i]:
                    worst = max(worst, t.dropped[i])
    return worst if batches is None else min(worst, max(batches - 1, 0))


def _received(t: Tracker, track: Track) -> bool:
    seq = t.last_seq
    return any(seq[i] > 0 for i in track.ids if i < len(seq))
