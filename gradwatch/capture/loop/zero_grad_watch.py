"""``clip_after_step`` evidence: were gradients changed after the step that consumed them?

``Optimizer`` has no ``zero_grad`` hook. One attribute set on each watched optimizer
*instance* (never on the class; wrappers such as accelerate's and Lightning's reach it
through the inner optimizer) calls back just before the gradients are reset; leaving the
watcher deletes it again (``Optimizer.__getstate__`` never pickles it). At that moment, if no
backward pass ran since the optimizer's last step, each gradient is compared with what the
step left (``Tracker.snapshot``: identity and version counter): a clip, scaling or noise in
between bumped the version or replaced the tensor, and acted on no update. Nothing is
copied and nothing syncs.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from gradwatch.capture.grads.evidence import Tracker, task_id
from gradwatch.capture.grads.window import Track

__all__ = ["AfterStepEdits", "ZeroGradWatch", "edited_since_step"]


SAMPLE = 16  # parameters looked at first; all of them only when one of these was edited


def edited_since_step(tracker: Tracker, track: Track) -> list[int]:
    """Parameters of ``track`` whose ``.grad`` changed since its optimizer's last step (call
    only while no backward pass ran since that step).

    A clip, a rescale or noise touches every gradient it is given: a spread sample is looked
    at first (a few microseconds on a model of 400 tensors), all of them only when one of
    the sample was edited.
    """
    sref, sver = tracker.snap_ref, tracker.snap_ver
    ids, params = track.ids, track.params
    stride = max(1, len(ids) // SAMPLE)
    if not any(_edited(sref[ids[k]], sver[ids[k]], params[k]) for k in range(0, len(ids), stride)):
        return []
    out = []
    for i, p in zip(ids, params):
        g = p.grad
        if g is None or sver[i] < 0:
            continue  # reset already, or the step left no gradient
        if sref[i]() is not g or g._version != sver[i]:
            out.append(i)
    return out


def _arrived_since(t: Tracker, start: int) -> bool:
    """A gradient arrived at the first-arriving parameter since ``start`` (it keeps its hook)."""
    return 0 <= t.leader < len(t.last_seq) and t.last_seq[t.leader] > start


def _edited(ref: Callable[[], Any], ver: int, p: Any) -> bool:
    g = p.grad
    return g is not None and ver >= 0 and (ref() is not g or g._version != ver)


class ZeroGradWatch:
    """Calls ``on_zero_grad(k)`` just before optimizer ``k``'s ``zero_grad`` runs."""

    def __init__(self, optimizers: list[Any], on_zero_grad: Callable[[int], None]) -> None:
        self._patched: list[weakref.ref[Any]] = []
        self._on_zero_grad = on_zero_grad
        self._covered = 0
        self.cover(optimizers)

    def cover(self, optimizers: list[Any]) -> None:
        """Wrap the optimizers of ``optimizers`` not seen yet (one added during the run)."""
        for k in range(self._covered, len(optimizers)):
            opt = optimizers[k]
            real = getattr(opt, "zero_grad", None)
            if real is None or "zero_grad" in getattr(opt, "__dict__", {"zero_grad": None}):
                continue  # none, or already wrapped by someone else: leave it alone
            opt.zero_grad = _wrapped(real, k, self._on_zero_grad)
            self._patched.append(weakref.ref(opt))
        self._covered = max(self._covered, len(optimizers))

    def remove(self) -> None:
        """Give each optimizer its own method back (idempotent)."""
        for ref in self._patched:
            opt = ref()
            if opt is not None:
                opt.__dict__.pop("zero_grad", None)
        self._patched.clear()


def _wrapped(real: Callable[..., Any], k: int, callback: Callable[[int], None]) -> Any:
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        callback(k)  # guarded by the caller: a fault never stops the reset
        return real(*args, **kwargs)

    return zero_grad


class AfterStepEdits:
    """Per optimizer, the gradients changed after its last step, seen at its ``zero_grad``
    and handed to its next step's window."""

    def __init__(
        self,
        tracker: Tracker,
        track_of: Callable[[int], Optional[Track]],
        backward_passes: Callable[[], int],
    ) -> None:
        self.tracker = tracker
        self._track_of = track_of
        self._backward_passes = backward_passes
        self._edits: dict[int, list[int]] = {}

    def zeroing(self, k: int) -> None:
        """Optimizer ``k`` is about to reset its gradients."""
        track = self._track_of(k)
        if (
            track is None
            or track.steps == 0
            or k in self._edits
            or self._backward_passes() != track.backward_at_start  # accumulated since: not ours
            or task_id() >= 0  # inside a backward (optimizer in backward, LBFGS's closure)
            or _arrived_since(self.tracker, track.start)  # a backward that raised
        ):
            return
        edited = edited_since_step(self.tracker, track)
        if edited:
            self._edits[k] = edited

    def take(self, k: Optional[int]) -> Optional[list[int]]:
        """The edits seen since optimizer ``k``'s previous step (once)."""
        return self._edits.pop(k, None) if k is not None else None
