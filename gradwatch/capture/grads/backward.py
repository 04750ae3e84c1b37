"""The end of each outermost backward pass, robust to nested and failed ones.

A gradient's arrival queues one callback on the autograd graph task it arrived in (keyed by
the engine's graph-task id, so a backward that raised half-way, whose callbacks never run,
does not block the next one). A reentrant ``torch.utils.checkpoint`` runs a *nested* engine
call inside the outer backward: its callbacks fire when the nested call ends, while the
outer one goes on. There the engine is still evaluating the outer node that started the
nested call, so the end is handed on to that node (a post hook on it queues the callback on
the outer task). One backward of the user's is thus one end, however deeply nested.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from gradwatch.capture.grads.evidence import Tracker, task_id

__all__ = ["BackwardEnds"]

_current_node: Callable[[], Any] = torch._C._current_autograd_node


class BackwardEnds:
    """Calls ``on_end`` once at the end of every outermost backward in which a gradient arrived."""

    def __init__(
        self,
        tracker: Tracker,
        on_end: Callable[[], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.tracker = tracker
        self._on_end = on_end
        self._on_error = on_error
        self._queued: set[int] = set()  # graph tasks with an end callback queued
        self._handles: list[RemovableHandle] = []  # post hooks on outer nodes (nesting)
        self._ended_task = -1  # the graph task whose outermost end ran last
        # Runs the deferred arrival hooks' work first (capture/grads/deferred.py).
        self.flush: Callable[[int], None] = _nothing

    def arrived(self) -> None:
        """A gradient arrived in a graph task not seen yet: queue that task's end callback."""
        gid = task_id()
        self.tracker.task = gid
        if gid == self._ended_task:
            # Its end already ran: a gradient assigned by a later end-of-backward callback of
            # the same task (FSDP2's, for a unit called outside its root's forward, as in
            # Lightning's training_step) belongs to the backward already counted.
            return
        self._queue(gid)

    def _queue(self, gid: int) -> None:
        if gid in self._queued or gid < 0:
            return
        self._queued.add(gid)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_callback(gid))

    def _end_callback(self, gid: int) -> Callable[[], None]:
        wself = weakref.ref(self)

        def end() -> None:
            me = wself()
            if me is not None:
                me._ended(gid)

        return end

    def _ended(self, gid: int) -> None:
        try:
            self.flush(gid)  # while this task is still queued: an arrival there queues no end
        except Exception as exc:
            self._on_error("backward end", exc)
        self._queued.discard(gid)
        node = _current_node()
        if node is not None:
            # A nested engine call (reentrant checkpoint) ended inside ``node`` of an outer
            # backward that goes on: hand the end on to it.
            fired = [False]
            wself = weakref.ref(self)

            def resume(grad_inputs: Any, grad_outputs: Any) -> None:
                me = wself()
                if me is None or fired[0]:
                    return  # once (a retained graph may run the node again)
                fired[0] = True
                try:
                    me._queue(task_id())
                except Exception as exc:
                    me._on_error("backward end", exc)

            self._handles.append(node.register_hook(resume))
            return
        # The outermost backward ended: tasks still marked are ones that raised (never end).
        self._ended_task = gid
        self.tracker.ended_at = self.tracker.now()
        self._queued.clear()
        self.tracker.task = -2
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self._on_end()

    def remove(self) -> None:
        """Drop the hooks left on outer nodes (the watcher closes)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._queued.clear()


def _nothing(gid: int) -> None:
    return None
