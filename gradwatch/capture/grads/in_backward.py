"""Arrivals no hook saw: optimizer steps inside a backward pass, gradients written by hand.

PyTorch's tutorial steps one optimizer per parameter from a
``register_post_accumulate_grad_hook`` and clears ``.grad`` right after: registered before
gradwatch's, that hook leaves gradwatch's own post hook a ``.grad`` of ``None``, so no
arrival is recorded. The step itself runs inside the backward's graph task, where a
``.grad`` that is not the tensor the last step left can only have been made by this backward:
it is read as an arrival, and the backward's end is queued as at any arrival.

A gradient written into ``.grad`` by hand (DP-SGD's per-sample gradients, clipped, noised and
averaged) is likewise the step's gradient (``written_arrive``).
"""

from __future__ import annotations

import weakref
from typing import Callable

from gradwatch.capture.grads.evidence import Tracker, task_id
from gradwatch.capture.grads.window import Gathered, Track

__all__ = ["note_hand_written", "read_in_backward", "written_arrive"]


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


def written_arrive(t: Tracker, g: Gathered) -> None:
    """Gradients written by hand (``g.written``) are this step's gradients: judged, counted
    and measured as ones that arrived."""
    arrived, seen, missing = g.arrived, t.seen, t.missing
    for k, (i, w) in enumerate(zip(g.ids, g.written)):
        if w and not arrived[k]:
            arrived[k] = True
            seen[i] += 1
            missing[i] -= 1
            t.last_seq[i] = t.now()


def note_hand_written(
    tracker: Tracker, track: Track, g: Gathered, backward_passes: int, exact: bool
) -> bool:
    """Mark the gradients no backward pass made: a ``.grad`` the last step did not leave, on
    a parameter no gradient arrived at (``torch.func.grad``/``torch.autograd.grad`` results
    written by hand, where no hook sees them). ``g.assigned``: there is such a ``.grad``
    (``loss_disconnected``: not a cut-off loss). ``g.written``: the non-zero ones, each a
    gradient: no ghost (zeros written for a layer that did not run are still a ghost).

    Returns whether the step found some and had no backward pass at all (``no_backward``).
    ``exact``: not under DDP, where the reducer writes the average into a parameter this
    rank's backward did not reach (find_unused_parameters): no arrival here, the rank
    exchange says where it arrived (a ghost on one rank is named by its rank).
    """
    if all(g.arrived):  # the usual step: one C call
        return False
    snap = tracker.snap_ref
    new = [gr is not None and snap[i]() is not gr for i, gr in zip(g.ids, g.grads)]
    g.assigned = any(new)
    if not g.assigned:
        return False
    written = [
        f and not a and n is not None and n != 0.0 for f, a, n in zip(new, g.arrived, g.grad_norm)
    ]
    if not any(written):
        return False
    g.written = written
    if exact:
        written_arrive(tracker, g)
    return backward_passes == track.backward_at_start
