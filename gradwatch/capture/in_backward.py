"""Optimizer steps taken inside a backward pass (the "optimizer in backward" pattern).

PyTorch's tutorial steps one optimizer per parameter from a
``register_post_accumulate_grad_hook`` and clears ``.grad`` right after: registered before
gradwatch's, that hook leaves gradwatch's own post hook a ``.grad`` of ``None``, so no
arrival is recorded. The step itself runs inside the backward's graph task, where a
``.grad`` that is not the tensor the last step left can only have been made by this backward:
it is read as an arrival, and the backward's end is queued as at any arrival.
"""

from __future__ import annotations

import weakref
from typing import Callable

from gradwatch.capture.evidence import Tracker, task_id
from gradwatch.capture.window import Track

__all__ = ["read_in_backward"]


def read_in_backward(tracker: Tracker, track: Track, on_arrival: Callable[[], None]) -> None:
    """Record as arrivals the gradients a step inside a backward pass finds (one C call
    outside backward, the usual case)."""
    if task_id() < 0:
        return
    t = tracker
    start, ls, snap = track.start, t.last_seq, t.snap_ref
    found = False
    for i, p in zip(track.ids, track.params):
        g = p.grad
        if g is None or ls[i] > start or snap[i]() is g:
            continue
        ls[i] = next(t.counter)
        t.acc_ref[i], t.acc_ver[i] = weakref.ref(g), g._version
        t.fresh[i] = False
        found = True
    if found:
        on_arrival()
