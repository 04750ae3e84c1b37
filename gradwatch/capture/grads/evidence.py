"""Hot per-parameter state and the hooks that write it.

Hooks only flip values in preallocated lists: no tensor work, no host sync, no allocation
except a 0-dim "any non-zero" tensor in the rare case where identity and version counter
cannot tell whether a gradient was reset (``p.grad.data.zero_()`` does not bump the version;
DDP bucket views share one counter).

Per parameter ``i``:
- ``last_seq[i]``: event counter at its last real gradient accumulation;
- ``fresh[i]``: no accumulation since its optimizer's last step;
- ``snap_ref/snap_ver``: identity and version of ``.grad`` right after that step;
- ``acc_ref/acc_ver``: identity and version of ``.grad`` right after its last accumulation;
- ``dirty[i]``: the gradient being built still holds contributions from before the last
  step: ``False``, ``True`` or a pending 0-dim bool tensor resolved at the next step.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Container
from typing import Any, Callable, Optional

import torch

from gradwatch.capture.forward.flow import upstream_layers
from gradwatch.model.locations import call_site

DirtyFlag = Any  # bool | torch.Tensor


def dead_ref() -> None:
    """A reference to no tensor (answers None, as a dead weak reference does)."""
    return None


Ref = Callable[[], Optional[torch.Tensor]]

# The autograd graph task running now (-1 outside backward): one end callback per task.
task_id: Callable[[], int] = torch._C._current_graph_task_id


class Tracker:
    """Per-parameter hot state, grown as parameters are registered."""

    def __init__(self) -> None:
        self.counter = itertools.count(1)
        self.last_seq: list[int] = []
        self.fresh: list[bool] = []
        self.dirty: list[DirtyFlag] = []
        # Identity by weak reference, not id(): a freed gradient's address is soon reused.
        self.snap_ref: list[Ref] = []
        self.snap_ver: list[int] = []
        self.acc_ref: list[Ref] = []
        self.acc_ver: list[int] = []
        self.incoming: list[bool] = []
        self.has_pre: list[bool] = []
        self.seen: list[int] = []
        self.missing: list[int] = []
        self.fwd_grad: dict[str, int] = {}
        self.fwd_nograd: dict[str, int] = {}
        self.fwd_first: dict[str, int] = {}
        self.fwd_since: dict[str, int] = {}  # layer -> event number its forward hook went on
        self.pending: set[int] = set()  # parameters whose dirty flag is an unresolved tensor
        # Micro-batches dropped before the step: a gradient reset (set_to_none) between two
        # backward passes of one window, no step of any optimizer and no change to the
        # parameter in between (zero_grad() inside the accumulation loop). SAM's and LBFGS's
        # resets follow a change to the parameters; a GAN's follow the other one's step.
        self.dropped: list[int] = []
        self.dropping: set[int] = set()  # parameters with dropped[i] > 0
        self.pver: list[int] = []  # the parameter's version at its window's first arrival
        self.stepped_at = 0  # event number of the latest step of any optimizer
        self.ended_at = 0  # event number of the latest backward pass that completed
        self.want_pre: set[int] = set()  # parameters whose resets only values can tell
        self.backward_queued = False  # the end-of-backward callback is queued
        self.task = (
            -2
        )  # the graph task whose end callback is queued (see capture/grads/backward.py)
        self.leader = -1  # the parameter that arrived first in the latest graph task
        self.want_call: set[str] = set()  # flagged layers whose caller's line is wanted
        self.called_at: dict[str, str] = {}  # layer -> "file:line" that called it
        # The forward's data flow, recorded until the first step (capture/forward/flow.py): layer
        # -> the layers nearest upstream of its inputs. ``layer_of`` names a parameter's
        # layer (set by the run, which holds the index).
        self.links: dict[str, frozenset[str]] = {}
        self.layer_of: Callable[[torch.Tensor], Optional[str]] = lambda t: None
        # Arrival order of the last step whose hooks were all on: a read step's order
        # (capture/grads/step_reading.py); None while every arrival is hooked.
        self.rank: Optional[dict[int, int]] = None

    def now(self) -> int:
        """A fresh event number (later than every event so far)."""
        return next(self.counter)

    def grow(self, n: int) -> None:
        """Make room for ``n`` parameters in total."""
        while len(self.last_seq) < n:
            self.last_seq.append(0)
            self.fresh.append(True)
            self.dirty.append(False)
            self.snap_ref.append(dead_ref)
            self.snap_ver.append(-1)
            self.acc_ref.append(dead_ref)
            self.acc_ver.append(-1)
            self.incoming.append(True)
            self.has_pre.append(False)
            self.seen.append(0)
            self.missing.append(0)
            self.dropped.append(0)
            self.pver.append(-1)

    def count_arrivals(
        self, ids: list[int], start: int, arrival: Optional[Callable[[int], bool]] = None
    ) -> list[bool]:
        """Which of ``ids`` got a gradient since event ``start`` (``arrival`` decides where
        the hooks cannot see them: FSDP1), counted into the ghost evidence (seen, missing)."""
        ls, seen, missing = self.last_seq, self.seen, self.missing
        arrived = [ls[i] > start for i in ids] if arrival is None else [arrival(i) for i in ids]
        for i, a in zip(ids, arrived):
            if a:
                seen[i] += 1
            else:
                missing[i] += 1
        return arrived

    def snapshot(
        self,
        ids: list[int],
        grads: list[Optional[torch.Tensor]],
        read: Container[int] = (),
        window: Optional[tuple[list[int], list[torch.Tensor]]] = None,
    ) -> None:
        """Record each ``.grad`` as its optimizer's step left it (identity and version).

        ``read``: parameters whose ``.grad`` this step's reading recorded as their last
        accumulation (``capture/grads/step_reading.py``), the same tensor at the same version
        now: copied from there, not read from the tensor again.

        ``window``: all of the window's (ids, parameters), where ``ids`` are the judged ones.
        One not judged this step (hooked during the window, frozen) was stepped all the same:
        its old record would read as an edit after this step at the next reset.
        """
        if window is not None and len(window[0]) != len(ids):
            judged = set(ids)
            rest = [(i, p) for i, p in zip(*window) if i not in judged]
            self.snapshot([i for i, _ in rest], [p.grad for _, p in rest])
        sref, sver, fresh, dirty = self.snap_ref, self.snap_ver, self.fresh, self.dirty
        aref, aver = self.acc_ref, self.acc_ver
        ref = weakref.ref
        for i, g in zip(ids, grads):
            if i in read:
                sref[i], sver[i] = aref[i], aver[i]
            elif g is None:
                sref[i], sver[i] = dead_ref, -1
            else:
                sref[i], sver[i] = ref(g), g._version
            fresh[i] = True
            dirty[i] = False
        if self.pending:
            self.pending.difference_update(ids)
        if self.dropping:
            for i in ids:
                self.dropped[i] = 0
            self.dropping.difference_update(ids)
        self.stepped_at = self.now()  # (without an optimizer no drop is judged)


def make_param_hooks(
    tracker: Tracker,
    i: int,
    pref: weakref.ref[torch.Tensor],
    on_arrival: Callable[[], None],
    on_error: Callable[[str, BaseException], None],
) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
    """The (tensor pre-accumulation hook, post-accumulate-grad hook) pair of parameter ``i``.

    The post-accumulate hook is always on. The pre-accumulation hook looks at the values of
    ``.grad`` before a gradient is added to them; it is on for the first steps
    (``trim_hooks_after``) and afterwards only where the version counter (``zero_()`` bumps
    it once, accumulating once more) and identity (``set_to_none``) cannot tell a reset apart
    (one bump: never reset, or reset by ``.data.zero_()``; DDP bucket views share a
    counter). The post hook asks for it back when such a case appears later. Most loops
    never need it after the first steps, which halves the Python calls per parameter.

    Closures hold a weak reference to the parameter: a hook that holds its own parameter
    is never freed (the C++ side keeps it out of reach of the garbage collector).
    """
    return _pre_hook(tracker, i, pref, on_error), _post_hook(tracker, i, on_arrival, on_error)


def _pre_hook(
    tracker: Tracker,
    i: int,
    pref: weakref.ref[torch.Tensor],
    on_error: Callable[[str, BaseException], None],
) -> Callable[[torch.Tensor], None]:
    """Parameter ``i``'s tensor pre-accumulation hook: was ``.grad`` reset since the step?"""
    t = tracker

    def pre(grad_in: Optional[torch.Tensor]) -> None:
        try:
            t.incoming[i] = grad_in is not None
            p = pref()
            if p is None:
                return None
            g = p.grad
            if g is None:
                clean = True
            elif t.fresh[i]:
                untouched = t.snap_ref[i]() is g and g._version == t.snap_ver[i]
                if untouched or g._base is not None:
                    # Same tensor, same version since the step: reset without a version bump
                    # (``.data.zero_()``) or not reset at all; a view's counter is shared.
                    # Only the values can tell; resolved at the next step, no sync here.
                    t.dirty[i] = torch.ne(g.detach(), 0).any()
                    t.pending.add(i)
                    t.want_pre.add(i)  # keep this hook when the others are trimmed
                    return None
                clean = True  # replaced or modified in place since the step: reset
            else:
                # reset between two backward passes of one step?
                clean = t.acc_ref[i]() is not g or (g._version != t.acc_ver[i] and g._base is None)
            if clean:
                t.dirty[i] = False
                if t.pending:
                    t.pending.discard(i)
        except Exception as exc:
            on_error("pre-accumulate hook", exc)
        return None

    return pre


def _post_hook(
    tracker: Tracker,
    i: int,
    on_arrival: Callable[[], None],
    on_error: Callable[[str, BaseException], None],
) -> Callable[[torch.Tensor], None]:
    """Parameter ``i``'s post-accumulate-grad hook: did a gradient arrive, and when?"""
    t = tracker

    def post(p: torch.Tensor) -> None:
        try:
            g = p.grad
            if g is None:
                return  # the hook fired but no gradient arrived (seen under torch.compile)
            ver = g._version
            if t.has_pre[i]:
                if not t.incoming[i]:
                    t.incoming[i] = True
                    return
            elif (t.acc_ref[i]() is g and ver == t.acc_ver[i]) or (
                t.snap_ref[i]() is g and ver == t.snap_ver[i]
            ):
                return  # fired, yet the gradient is untouched: nothing arrived
            elif (
                t.fresh[i]
                and t.snap_ref[i]() is g
                and (g._base is not None or ver < t.snap_ver[i] + 2)
            ):
                t.want_pre.add(i)  # accumulated into the step's gradient: reset or not?
            elif t.pending and i in t.pending:
                # No value check here (trimmed): a flag capture/grads/resets.py raised at an earlier
                # backward's start is void when the gradient was reset since (a GAN's G).
                # Fresh and reaching here: replaced or zero_()'d since the step.
                if (
                    t.fresh[i]
                    or t.acc_ref[i]() is not g
                    or (g._base is None and ver != t.acc_ver[i] + 1)
                ):
                    t.dirty[i] = False
                    t.pending.discard(i)
            if t.fresh[i]:
                t.pver[i] = p._version
            elif t.acc_ref[i]() is not g and t.stepped_at < t.last_seq[i] < t.ended_at:
                if p._version == t.pver[i]:  # dropped unused (no SAM, no failed backward)
                    t.dropped[i] += 1
                    t.dropping.add(i)
            t.last_seq[i] = next(t.counter)
            t.acc_ref[i], t.acc_ver[i] = weakref.ref(g), ver
            t.fresh[i] = False
            if t.task != task_id():  # first arrival in this graph task (nested ones too)
                t.leader = i
                on_arrival()
        except Exception as exc:
            on_error("post-accumulate hook", exc)

    return post


def _never_compiling() -> bool:
    return False


# ``torch.compiler.is_compiling`` (torch >= 2.3) is folded to a constant by dynamo.
_is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", _never_compiling
)


def make_forward_hook(
    tracker: Tracker,
    layer: str,
    on_error: Optional[Callable[[str, BaseException], None]] = None,
) -> Callable[..., None]:
    """A forward hook that stamps when ``layer`` ran, with or without grad mode.

    A fault inside it goes to ``on_error`` (it runs inside the user's forward pass: it must
    never break it); without ``on_error`` it propagates.
    """
    t = tracker

    def forward_hook(module: Any, args: Any, output: Any) -> None:
        if _is_compiling():
            # Traced by dynamo, this body would be guarded on (the counter changes every
            # call: a recompile each step until dynamo gives up and runs the model
            # eagerly), and no runtime side effect survives inlining without a graph break.
            # So a compiled model's layers leave no stamp: a ghost's cause reads "unknown".
            return
        try:
            seq = next(t.counter)
            if torch.is_grad_enabled():
                t.fwd_grad[layer] = seq
                if not t.stepped_at and layer not in t.links:  # once per layer, first window
                    t.links[layer] = upstream_layers(args, t.layer_of, layer)
            else:
                t.fwd_nograd[layer] = seq
            if layer not in t.fwd_first:
                t.fwd_first[layer] = seq
            if t.want_call and layer in t.want_call:  # once, for a flagged layer only
                t.want_call.discard(layer)
                site = call_site()
                if site is not None:
                    t.called_at[layer] = site
        except Exception as exc:
            if on_error is None:
                raise
            on_error("forward hook", exc)

    return forward_hook


def make_cause(index: Any, tracker: Tracker, start: int, wanted: set[str]) -> Callable[[int], str]:
    """Why parameter ``i`` got no gradient in the window that began at event ``start``.

    From the forward hooks' stamps of its owning layers: ``not_called`` (no forward),
    ``no_grad`` (only forwards with grad disabled), ``disconnected`` (a forward with grad whose
    output never reached the loss), ``unknown`` when its forward hook was off (trimmed): the
    layer is then added to ``wanted`` so its hook comes back.
    """

    def cause(i: int) -> str:
        info = index.params[i]
        if info.outside_model:
            return "unknown"
        since = tracker.fwd_since
        if not any(since.get(o, start + 1) <= start for o in info.owners):
            # Its forward hook was off (trimmed after trim_hooks_after) during this window.
            wanted.add(info.layer)
            return "unknown"
        if any(tracker.fwd_grad.get(o, 0) > start for o in info.owners):
            return "disconnected"
        if any(tracker.fwd_nograd.get(o, 0) > start for o in info.owners):
            return "no_grad"
        return "not_called"

    return cause
