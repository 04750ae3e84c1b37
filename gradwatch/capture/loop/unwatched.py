"""Optimizer steps gradwatch cannot see: re-entrant ``step()`` calls and replaced optimizers.

- An optimizer subclass whose ``step`` calls ``super().step()`` runs the step hooks twice
  when the parent class was patched too (torch wraps each class's ``step`` once): the inner
  call is the same step, not a second one.
- A training loop that builds a new optimizer object mid-run keeps training, but the watched
  optimizer never steps again: the parameters keep changing (their version counters move)
  across backward passes with no watched step. That is said, not silently ignored.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional

import torch

from gradwatch.capture.facts import UNOBSERVABLE, Fact, Report

__all__ = ["StepNesting", "UnwatchedUpdates"]


class StepNesting:
    """Tells an outer ``step()`` from a nested one, per optimizer.

    The outer call's frame is kept until its post-hook; a pre-hook that finds it still on the
    stack is nested. A step that raised never reaches its post-hook: its frame is then no
    longer on the stack, and the next call is a new step, not a nested one.
    """

    def __init__(self) -> None:
        self._outer: dict[int, FrameType] = {}
        self._nested: dict[int, int] = {}

    def enter(self, k: int, caller: FrameType) -> bool:
        """At optimizer ``k``'s pre-step hook: whether this is an outer (real) step.

        ``caller`` is the frame that called the hook: torch's step wrapper of this call.
        """
        outer = self._outer.get(k)
        if outer is not None and _on_stack(outer):
            self._nested[k] = self._nested.get(k, 0) + 1
            return False
        self._outer[k], self._nested[k] = caller, 0
        return True

    def leave(self, k: int) -> bool:
        """At optimizer ``k``'s post-step hook: whether the outer step ends here."""
        if self._nested.get(k, 0) > 0:
            self._nested[k] -= 1
            return False
        self._outer.pop(k, None)
        return True

    def inside(self) -> bool:
        """Whether some watched optimizer's step is running (an LBFGS closure's backward)."""
        return any(_on_stack(f) for f in self._outer.values())

    def clear(self) -> None:
        self._outer.clear()
        self._nested.clear()


def _on_stack(frame: FrameType) -> bool:
    f: Optional[FrameType] = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class UnwatchedUpdates:
    """Counts backward passes across which an optimizer's parameters moved without its step.

    An optimizer moves every parameter it holds that has a gradient; a forward that edits a
    weight in place moves that one alone (``nn.Embedding(max_norm=...)`` renormalises the
    rows it looks up, on every forward, also during gradient accumulation). So a pass counts
    only when every sampled parameter with a gradient moved.
    """

    SAMPLE = 8  # parameters looked at per optimizer: their version counters, nothing else

    def __init__(self) -> None:
        self._mark: dict[int, list[int]] = {}
        self._count: dict[int, int] = {}

    @staticmethod
    def _versions(params: list[torch.Tensor]) -> list[int]:
        return [p._version for p in params[: UnwatchedUpdates.SAMPLE]]

    def stepped(self, k: int, params: list[torch.Tensor]) -> None:
        """Optimizer ``k`` stepped (its post-step hook): the parameters as it left them."""
        self._mark[k] = self._versions(params)
        self._count[k] = 0

    def explained(self, k: int, params: list[torch.Tensor]) -> None:
        """Another watched optimizer stepped: changes to ``k``'s parameters so far are its own.

        A parameter held by two optimizers used in different phases moves by the active one's
        watched steps while the other is idle: that is not an unwatched optimizer.
        """
        if k in self._mark:
            self._mark[k] = self._versions(params)

    def backward(self, k: int, params: list[torch.Tensor]) -> int:
        """A backward pass ended with no step of ``k`` since the previous one.

        Returns how many such passes in a row saw the parameters change.
        """
        now = self._versions(params)
        before = self._mark.get(k)
        if before is not None and len(before) == len(now) and _all_moved(params, before, now):
            self._count[k] = self._count.get(k, 0) + 1
        self._mark[k] = now
        return self._count.get(k, 0)

    def look(self, track: Any, backward_passes: int, structure: Any, report: Report) -> None:
        """After a backward pass with no step of ``track``'s optimizer: moved without it?"""
        k = track.index
        waiting = backward_passes - track.backward_at_start
        if waiting < 2:
            return
        moved = self.backward(k, track.params)
        if moved < 2:
            return
        opt = structure.optimizers[k]
        reason = f"optimizer_{k}_not_stepping"
        fact = Fact(
            UNOBSERVABLE,
            step=track.steps,
            key=reason,
            message=f"The parameters of watched optimizer {k} ({type(opt).__name__}) keep "
            f"changing across backward passes, but its step() has not run for {waiting} "
            "passes: another optimizer object is training them, unwatched.",
            hint="Was the optimizer re-created mid-run? gradwatch watches the object passed "
            "to watch(): open a new watch() with the new optimizer (or pass all of them).",
            details={"reason": reason, "optimizer": k, "backward_passes": moved},
        )
        report(fact)


def _all_moved(params: list[torch.Tensor], before: list[int], now: list[int]) -> bool:
    """Whether some sampled parameter moved, and every one holding a gradient did."""
    with_grad = [j for j in range(len(now)) if params[j].grad is not None]
    return bool(with_grad) and all(now[j] != before[j] for j in with_grad)
