"""Arrival read at the step, not by a hook, where the loop makes ``.grad`` say it exactly.

A post-accumulate hook per parameter is a Python call per parameter and backward pass: on a
model of 400 tensors, 2-3 ms a step, most of what gradwatch costs once its first steps are
over. In a loop that resets with ``set_to_none`` (``zero_grad()``'s default), what the step
finds in ``.grad`` says whether a gradient arrived since the last step:

- ``None``: nothing arrived since the reset;
- the tensor the last step left, at the same version: nothing arrived;
- another tensor: the reset dropped the old one and an accumulation made this one.

At the first step after ``trim_hooks_after`` (every hook still on), a parameter whose hook
and reading agree, with a gradient made anew since the last step, is *read*: its arrival hook
comes off, and each step writes the evidence the hook would have (``read_arrivals``). Where the
arrival hooks are light (``capture/grads/deferred.py``), the ones that stay on become post
hooks then, and the ones hooked in turn stay light: torch keeps no hook on a read one.
Hooks stay on the parameter that arrives first (it counts backward passes; the reset sweep
runs at its arrival), on value-checked, shared and pending ones, and on sentinels: a spread
sample plus a few read ones in turn (``ROTATE``, every ``PACE`` steps), whose hook and
reading are compared, so every read parameter is compared within ``PACE * n / ROTATE`` steps.
A turn costs about 17 us a parameter (its light hook registered, fired and released): taken
every step it was the largest part of what reading leaves on model (a). A parameter that
disagrees from the start is not read at all (``choose``): turns only catch a loop that
changes later.

Doubt puts hooks back; it never guesses:
- a reading that is none of the plain cases (the same tensor at another version: ``zero_()``,
  an edit in place, a view) puts that parameter's hook back; it is not judged this step;
- a sentinel whose hook and reading disagree (gradients cleared between backward and step,
  or written by hand), or an arrival read in a window without a backward pass, puts every
  hook back for good; no read parameter is judged this step.

A read step has no arrival order: a NaN's origin (the first in backward order) is taken from
the order of the last step whose hooks were all on (``Tracker.rank``). Not read at all:
DDP and sharded engines (bucket views, reducer writes), ``torch.compile`` and a GradScaler
(``clipped_while_scaled`` needs each accumulation's version).
"""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Any, Optional

import torch

from gradwatch.capture.grads.evidence import Tracker, dead_ref
from gradwatch.capture.grads.hooks import HookSet
from gradwatch.capture.grads.in_backward import read_in_backward
from gradwatch.capture.grads.window import Gathered, Track

__all__ = ["MIN_READ", "ReadGrads", "StepReading", "reading", "shared_ids"]

_grad = attrgetter("grad")
ReadGrads = tuple[list[torch.Tensor], list[Optional[torch.Tensor]]]  # params, their .grad

MIN_READ = 64  # fewer readable tensors: their hooks cost too little to be worth it
SENTINELS = 16  # spread sample per optimizer that keeps its hooks
ROTATE = 16  # read parameters hooked in turn, to compare hook and reading
PACE = 4  # steps from one turn to the next


def reading(t: Tracker, i: int, g: Optional[torch.Tensor]) -> Optional[bool]:
    """Did a gradient arrive at parameter ``i`` since the last step (``None``: ``.grad``
    cannot tell)?"""
    if g is None:
        return False
    if g._base is not None:
        return None  # a view: its version counter is shared
    if t.snap_ref[i]() is not g:
        return True
    if g._version == t.snap_ver[i]:
        return False
    # The same tensor, changed: accumulated into, or edited in place. A value check at
    # the backward's start (capture/grads/resets.py) says it was not reset: an accumulation.
    return True if i in t.pending else None


class StepReading:
    """Which parameters' arrivals the step reads, and the reading itself."""

    def __init__(self, tracker: Tracker, hooks: HookSet) -> None:
        self.tracker = tracker
        self.hooks = hooks
        self.sentinels: set[int] = set()
        self.rotating: dict[Optional[int], list[int]] = {}  # per optimizer, hooked this window
        self._turn: dict[Optional[int], int] = {}
        self._tried: set[Optional[int]] = set()  # optimizers already considered
        self.read_now: set[int] = set()  # parameters whose arrival this step read
        self.arrived_now: set[int] = set()  # those of them whose gradient arrived
        # (the track's parameters, their ``.grad``) as this step's reading found them: the
        # step's gather takes the list (``take_grads``) instead of reading each ``.grad`` again
        self.grads: Optional[ReadGrads] = None
        self.off = False  # gave up for good

    # -- the pipeline's two calls ----------------------------------------------------------

    def before_gather(self, pipe: Any, track: Track) -> bool:
        """Read this step's arrivals where no hook records them; whether the loop allows it.

        ``pipe`` is the :class:`~gradwatch.core.steps.StepPipeline` (typed loosely: that
        module imports this one). A step inside a backward pass reads its new gradients
        first (``capture/grads/in_backward.py``).
        """
        self.hooks.arrival.deferred.flush()
        read_in_backward(self.tracker, track, pipe.hooks.note_arrival)
        self.grads = None
        self.read_now, self.arrived_now = set(), set()  # until read_arrivals reads this step
        readable = (
            track.index is not None
            and pipe.dist is None
            and pipe.sharded is None
            and track.sharded is None
            and not self.hooks.keep_all
            and pipe.scaler.scaler is None
        )
        if self.hooks.unhooked:
            self.read_arrivals(track, pipe.backward_passes > track.backward_at_start, readable)
        return readable

    def take_grads(self) -> Optional[ReadGrads]:
        """This step's (parameters, ``.grad`` list), once: held no longer, since the next
        ``zero_grad`` must be able to free those gradients."""
        grads, self.grads = self.grads, None
        return grads

    def after_gather(self, g: Gathered, track: Track, readable: bool, tracks: list[Track]) -> None:
        """Complete what only a hook sees; at the first step after the trim, choose. Hooks
        that stay on for good are then post hooks (a light one costs two calls)."""
        self.complete(g)
        if not self.hooks.trimmed:
            return
        k = track.index
        if readable and k not in self._tried and g.ks is track.positions and not any(g.nonfinite):
            self.choose(track, g, shared_ids(tracks))
        if not readable or k in self._tried:
            self.hooks.arrival.settle_all(track.ids, self.rotating.get(k, ()))

    # -- choosing ---------------------------------------------------------------------------

    def choose(self, track: Track, g: Gathered, shared: set[int]) -> None:
        """At the first step after the trim: the parameters of ``track`` the step can read."""
        if self.off or track.index in self._tried:
            return
        self._tried.add(track.index)
        t, hooks = self.tracker, self.hooks
        keep = t.want_pre | t.pending | shared | {t.leader}
        open_ = [
            (i, a, gr)
            for i, a, gr in zip(g.ids, g.arrived, g.grads)
            if i not in keep and not t.has_pre[i] and i in hooks.param
        ]
        made = [i for i, a, gr in open_ if a and reading(t, i, gr) is True]
        if len(made) < MIN_READ:
            return
        sample = set(made[:: max(1, len(made) // SENTINELS)])
        self.sentinels |= sample
        # The order of this step's arrivals stands for a read step's (a NaN's origin).
        rank = t.rank if t.rank is not None else {}
        rank.update({i: t.last_seq[i] for i, a in zip(g.ids, g.arrived) if a})
        t.rank = rank
        absent = [i for i, a, gr in open_ if not a and gr is None]  # nothing to read: None
        for i in [*made, *absent]:
            if i not in sample:
                hooks.unhook_post(i)
        self._rotate(track)

    # -- each step --------------------------------------------------------------------------

    def read_arrivals(self, track: Track, backward_ran: bool, readable: bool) -> None:
        """Write what each read parameter's hook would have, before the step is gathered.

        ``readable``: the loop still allows reading (no scaler or engine has appeared since).
        """
        hooks, t = self.hooks, self.tracker
        unhooked = hooks.unhooked
        if self.off:  # a parameter frozen when every hook came back trains again
            self.give_up()
        if not unhooked or self.off:
            return
        start = track.start
        watched = self.sentinels.union(self.rotating.get(track.index, ()))
        arrived: list[int] = []  # parameter ids, and their gradients in ``grads``
        grads: list[torch.Tensor] = []
        read: list[int] = []
        unclear: list[int] = []
        doubt = not readable
        snap_ref = t.snap_ref
        all_grads = list(map(_grad, track.params))  # one C-level pass; gather takes it too
        self.grads = (track.params, all_grads)
        for i, g in zip(track.ids, all_grads):
            if i in unhooked:
                if g is None:  # the usual cases first, inline: this runs on every step
                    read.append(i)
                elif g._base is None and snap_ref[i]() is not g:
                    read.append(i)
                    arrived.append(i)
                    grads.append(g)
                else:
                    plain = reading(t, i, g)
                    if plain is None:
                        unclear.append(i)
                        continue
                    read.append(i)
                    if plain:
                        arrived.append(i)
                        grads.append(g)
            elif i in watched and reading(t, i, g) is not (t.last_seq[i] > start):
                doubt = True
        if doubt or (arrived and not backward_ran):
            self.give_up()
            return
        for i in unclear:
            hooks.rehook_post(i)
            self._not_judged(i)
        pending = t.pending
        for i, g in zip(arrived, grads) if pending else ():
            if i in pending:
                if snap_ref[i]() is g:  # not reset since the step: the value check holds
                    t.want_pre.add(
                        i
                    )  # and stays on (capture/grads/hooks.py restores it with its hook)
                else:  # reset since the flag was raised (a GAN's G): void
                    t.dirty[i] = False
                    pending.discard(i)
        # One event number for all: a read step has no arrival order (Tracker.rank has it).
        seq = next(t.counter)
        last_seq, acc_ref, acc_ver, fresh = t.last_seq, t.acc_ref, t.acc_ver, t.fresh
        ref = weakref.ref
        for i, g in zip(arrived, grads):
            # An old reference is dropped before the new one is made: allocated first, 400
            # new references on top of 400 old ones would trip a collection of the garbage
            # collector's youngest generation at most steps, promoting live references to
            # the costly old generation (0.25 ms a step). ``acc_ref[i]`` is replaced just
            # below whatever it held; ``snap_ref[i]`` (often the same reference) only where
            # it is dead, where ``dead_ref`` answers as it does.
            acc_ref[i] = dead_ref
            if snap_ref[i]() is None:
                snap_ref[i] = dead_ref
            last_seq[i] = seq
            acc_ref[i] = ref(g)
            acc_ver[i] = g._version
            fresh[i] = False
        self.read_now, self.arrived_now = set(read), set(arrived)
        self._rotate(track)

    def complete(self, g: Gathered) -> None:
        """What only a hook could have seen, for the parameters this step read.

        - A NaN's origin: arrival order from the last step whose hooks were all on.
        - Gradients all zero at the step (``step_without_grad``): only a hook sees an edit
          after the accumulation, so a read zero gradient counts as cleared when every
          hooked one that arrived was.
        """
        read = self.read_now
        if not read or not (g.order or any(g.cleared)) or not read.intersection(g.ids):
            return
        rank = self.tracker.rank
        if g.order and rank is not None:
            far = max(rank.values(), default=0) + 1
            g.order = [rank.get(i, far) for i in g.ids]
        if any(g.cleared):
            hooked = [c for i, a, c in zip(g.ids, g.arrived, g.cleared) if a and i not in read]
            if hooked and all(hooked):
                g.cleared = [c or (i in read) for i, c in zip(g.ids, g.cleared)]

    # -- hooks back -------------------------------------------------------------------------

    def _rotate(self, track: Track) -> None:
        """The read parameters hooked in turn: last window's go back to being read."""
        hooks, t, k = self.hooks, self.tracker, track.index
        for i in self.rotating.pop(k, []):
            if i in hooks.param and i not in t.want_pre and not t.has_pre[i]:
                hooks.unhook_post(i)
        if track.steps % PACE:
            return  # the turns come every PACE steps
        read = [i for i in track.ids if i in hooks.unhooked]
        if not read:
            return
        turn = self._turn.get(k, 0) % len(read)
        now = read[turn : turn + ROTATE]
        self._turn[k] = turn + ROTATE
        for i in now:
            hooks.rehook_post(i, light=True)
        self.rotating[k] = now

    def give_up(self) -> None:
        """Every hook back for good; no read parameter is judged in its current window."""
        self.off = True
        self.tracker.rank = None
        unhooked = self.hooks.unhooked
        for i in list(unhooked):
            self.hooks.rehook_post(i)
            if i not in unhooked:  # a frozen one stays unhooked until it trains again
                self._not_judged(i)
        self.rotating.clear()
        self.sentinels.clear()
        self.read_now, self.arrived_now = set(), set()

    def _not_judged(self, i: int) -> None:
        """Hooked since the window began: its evidence counts from the next window."""
        hooks = self.hooks
        hooks.hooked_at[i] = hooks.last_hooked = self.tracker.now()


def shared_ids(tracks: list[Track]) -> set[int]:
    """Parameters that more than one optimizer holds (``double_update`` needs their hooks)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for track in tracks:
        for i in track.ids:
            (shared if i in seen else seen).add(i)
    return shared
