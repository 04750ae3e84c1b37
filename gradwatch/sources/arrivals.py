"""What the gradient hooks left for the window's checks: each parameter's last accumulation
(event number and the gradient it left) and whether a ``.grad`` was replaced by hand."""

from __future__ import annotations

from typing import Any

from gradwatch.sources.base import EvidenceSource, StepState

__all__ = ["ArrivalSource"]


class ArrivalSource(EvidenceSource):
    name = "arrivals"
    serves = frozenset()
    always = True

    def window(self, state: StepState) -> dict[str, Any]:
        tracker = self.ctx.tracker
        last_seq, acc_ref = tracker.last_seq, tracker.acc_ref
        assert state.gathered is not None
        return {
            "acc_state": lambda i: (last_seq[i], acc_ref[i]()),
            # Gradients written by hand (p.grad = torch.autograd.grad(...)) fire no
            # accumulation hook: a new .grad tensor since the last step (core/steps.py)
            # tells them apart from a cut-off loss.
            "grads_assigned": state.gathered.assigned,
        }
