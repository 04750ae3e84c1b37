"""Optimizers that never stepped while another watched optimizer did (read once, at the end).

One of a GAN's two optimizers forgotten: its parameters get gradients every iteration (the
other model's loss flows through them too) and never move. Read from the tracker's arrival
stamps, no hook of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from gradwatch.capture.grads.evidence import Tracker
from gradwatch.capture.grads.window import Track

__all__ = ["idle_optimizers"]


def idle_optimizers(
    tracker: Tracker, tracks: Sequence[Track], names: Callable[[list[int]], list[str]]
) -> list[tuple[int, list[str]]]:
    """(optimizer index, names of its trainable parameters that received a gradient) for
    each optimizer that never stepped, when another one did."""
    if not any(t.index is not None and t.steps > 0 for t in tracks):
        return []
    seq = tracker.last_seq
    out = []
    for track in tracks:
        if track.index is None or track.steps > 0:
            continue
        got = [
            i
            for i, p in zip(track.ids, track.params)
            if p.requires_grad and i < len(seq) and seq[i] > 0
        ]
        if got:
            out.append((track.index, names(got)))
    return out
