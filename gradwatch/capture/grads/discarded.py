"""Micro-batches whose gradients were reset before the step that should have used them.

``zero_grad()`` inside a gradient-accumulation loop leaves the step only the last
micro-batch's gradient. The post-accumulate hook counts each reset (``set_to_none``: a new
``.grad`` tensor) between two backward passes of one window (``Tracker.dropped``); this reads
the count at the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Track

__all__ = ["discarded_passes", "hear_other_steps"]


def hear_other_steps(
    tracker: Tracker,
    tracks: Callable[[], Sequence[Track]],
    on_error: Callable[[str, BaseException], None],
) -> Callable[[], None]:
    """Mark the step of an optimizer this watcher does not watch, whose parameters hold
    gradients, as a step of ``tracker`` (``stepped_at``); return the hook's remover.

    Each model watched by its own watcher (a GAN: ``watch(netD, optD), watch(netG, optG)``):
    the generator's backward passes through the discriminator, and ``netD.zero_grad()``
    discards those gradients at the next iteration, by design. That backward also reached
    parameters another optimizer holds, which stepped on them before the reset: the
    gradients were that optimizer's loss's, not a micro-batch dropped by ``zero_grad()``
    inside an accumulation loop (where no optimizer steps between backward and reset)."""

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        try:
            if any(t.ref is not None and t.ref() is opt for t in tracks()):
                return  # its own steps: the snapshot marks them
            for group in opt.param_groups:
                if any(getattr(p, "grad", None) is not None for p in group["params"]):
                    tracker.stepped_at = tracker.now()
                    return
        except Exception as exc:
            on_error("another optimizer's step hook", exc)

    return register_optimizer_step_post_hook(hook).remove


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
