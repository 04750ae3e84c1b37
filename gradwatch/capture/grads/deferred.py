"""Arrival hooks that torch can drop: a tensor pre-hook, its post-accumulation work deferred.

torch keeps a parameter's post-accumulate hook in C++ after its handle is removed, and calls
it, empty, at every backward pass: 0.8 us a parameter, about 0.3 ms a step on 400 small
parameters whose arrival the step reads (``capture/grads/step_reading.py``) after their hooks
came off (``benchmarks/backward_hooks.py``). A tensor pre-hook is dropped for good once its
dict is cleared (:func:`~gradwatch.capture.grads.tensor_hooks.release_pre_hooks`). So on one device,
without an engine and not compiled, the arrival hook of a parameter that may later be read is
a tensor pre-hook (:class:`Deferred`): it notes what ``.grad`` was before the accumulation and
runs the post-accumulate hook's work (``evidence.py``'s ``post``) at the next such hook on the
same thread, at the optimizer's step, or at the backward's end, whichever comes first. Only
other nodes of the graph run in between; what could touch ``.grad`` there is told apart:

- a parameter with someone else's post-accumulate hook (an optimizer stepped inside the
  backward pass, which clears ``.grad``) gets a real post hook, first in line, at once;
- ``torch.autograd.grad`` runs tensor pre-hooks without accumulating: a ``.grad`` that is
  the same tensor at the same version at the flush is no arrival;
- the device threads of a multi-device backward each flush their own queue; a backward's
  end flushes its graph task's entries on every thread (another thread's may still run).
"""

from __future__ import annotations

import weakref
from threading import get_ident
from typing import Callable, Optional

import torch

from gradwatch.capture.grads.evidence import task_id

__all__ = ["Deferred"]

Post = Callable[[torch.Tensor], None]
# (the post-accumulate work, the parameter, its .grad and that .grad's version before, the
# graph task)
Entry = tuple[Post, "weakref.ref[torch.Tensor]", Optional[torch.Tensor], int, int]

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Deferred:
    """The deferred arrival hooks of one watcher and their queues."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._on_error = on_error
        self._queues: dict[int, list[Entry]] = {}  # thread -> its pending entries
        self._tasks: set[int] = set()  # graph tasks with a flush callback queued
        # Parameter ``i`` has another post-accumulate hook: give it a real one, first.
        self.settle_first: Callable[[int], None] = _nothing

    def make(self, i: int, pref: weakref.ref[torch.Tensor], post: Post) -> Callable[..., None]:
        """Parameter ``i``'s deferring tensor pre-hook, doing ``post``'s work one hook later."""
        queues, tasks = self._queues, self._tasks
        run, settle, flush_at_end = _run, self, self._flush_at_end

        def hook(grad_in: Optional[torch.Tensor]) -> None:
            if grad_in is None:
                return None  # nothing to accumulate
            try:
                me = get_ident()
                q = queues.get(me)
                if q:
                    run(q)  # the parameters before this one on this thread accumulated
                p = pref()
                if p is None:
                    return None
                if p._post_accumulate_grad_hooks:
                    settle.settle_first(i)  # fires after this very accumulation
                    return None
                g = p.grad
                gid = task_id()
                entry = (post, pref, g, -1 if g is None else g._version, gid)
                if q is None:
                    queues[me] = [entry]
                else:
                    q.append(entry)
                if gid not in tasks:
                    tasks.add(gid)
                    _queue_callback(flush_at_end(gid))
            except Exception as exc:
                self._on_error("pre-accumulate hook", exc)
            return None

        torch.utils.hooks.unserializable_hook(hook)
        return hook

    def flush(self, gid: Optional[int] = None) -> None:
        """Run the pending entries of graph task ``gid`` on every thread (its backward
        ended), or, with ``None``, this thread's (a step is about to read the evidence).

        Another thread's backward may be accumulating into its parameters right now."""
        if gid is None:
            q = self._queues.get(get_ident())
            if q:
                _run(q)
            return
        for q in list(self._queues.values()):
            if q:
                _run(q, gid)

    def clear(self) -> None:
        """Drop what is pending (the watcher closes)."""
        self._queues.clear()
        self._tasks.clear()

    def _flush_at_end(self, gid: int) -> Callable[[], None]:
        wself = weakref.ref(self)

        def end() -> None:
            me = wself()
            if me is not None:
                me._tasks.discard(gid)
                try:
                    me.flush(gid)
                except Exception as exc:
                    me._on_error("backward end", exc)

        return end


def _run(q: list[Entry], gid: Optional[int] = None) -> None:
    """Each entry's post-accumulate work (of graph task ``gid`` only, if given), in arrival
    order, where ``.grad`` changed."""
    if gid is None:
        entries = q[:]
        q.clear()
    else:
        entries = [e for e in q if e[4] == gid]
        q[:] = [e for e in q if e[4] != gid]
    for post, pref, g0, v0, _ in entries:
        p = pref()
        if p is None:
            continue
        g = p.grad
        if g is g0 and (g is None or g._version == v0):
            continue  # hooked without accumulating (torch.autograd.grad)
        post(p)


def _nothing(i: int) -> None:
    return None
