"""``scheduler_misstepped`` evidence: how often each LR scheduler of an optimizer stepped.

Nothing is hooked or patched. A torch ``LRScheduler`` marks the optimizer it drives (its
``step`` is wrapped, ``_wrapped_by_lr_sched``) and counts its own steps (``last_epoch``,
``_step_count``). The schedulers are found once, from the optimizer's referrers (one
``gc.get_referrers`` the first time an optimizer carries the mark), and at each step of that
optimizer their counters are read: the scheduler steps since its previous step.
"""

from __future__ import annotations

import gc
from typing import Any

__all__ = ["SchedulerCounts"]


def _scheduler_states(opt: Any) -> list[dict[str, Any]]:
    """The ``__dict__`` of every LR scheduler whose ``optimizer`` is ``opt``."""
    found: list[dict[str, Any]] = []
    for r in gc.get_referrers(opt):
        d = r if isinstance(r, dict) else getattr(r, "__dict__", None)
        if (
            isinstance(d, dict)
            and d.get("optimizer") is opt
            and isinstance(d.get("last_epoch"), int)
            and "_step_count" in d
            and all(d is not f for f in found)
        ):
            found.append(d)
    return found


def _optimizer_steps(opt: Any) -> int:
    """The step count an optimizer's state holds (Adam's ``state[p]["step"]``), 0 if none."""
    for st in getattr(opt, "state", {}).values():
        step = st.get("step") if isinstance(st, dict) else None
        if step is not None:
            return int(step)
    return 0


class SchedulerCounts:
    """Per optimizer: its schedulers' step counters, read at each of its steps."""

    def __init__(self) -> None:
        self._states: dict[int, list[dict[str, Any]]] = {}
        self._last: dict[int, list[int]] = {}

    def read(self, k: int, opt: Any, first: bool) -> list[tuple[int, bool]]:
        """Per scheduler of ``opt``: (its steps since optimizer ``k``'s previous step, whether
        they were taken before the optimizer's first step). Read after the step."""
        states = self._states.get(k)
        if states is None:
            if not hasattr(getattr(opt, "step", None), "_wrapped_by_lr_sched"):
                return []  # no scheduler was ever built on it (so far)
            states = self._states[k] = _scheduler_states(opt)
            self._last[k] = [d["last_epoch"] for d in states]
            if not first or _optimizer_steps(opt) > 1:
                return []  # built later, or resumed from a checkpoint: counted from here
            # Its first step: a fresh scheduler has stepped once, in its constructor.
            return [(int(d["_step_count"]) - 1, True) for d in states]
        out = []
        last = self._last[k]
        for j, d in enumerate(states):
            now = d["last_epoch"]
            out.append((now - last[j], False))
            last[j] = now
        return out

    def release(self) -> None:
        self._states.clear()
        self._last.clear()
