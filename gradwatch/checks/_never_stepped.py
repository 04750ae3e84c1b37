"""``stale_param`` with ``details.cause: never_stepped``: an optimizer forgotten.

Its parameters received gradients, yet it never stepped while another watched optimizer
did (one of a GAN's two ``step()`` calls missing): they never move. Judged once, at the end
of the run, as an error whatever ``stale_param``'s own severity (the model part does not
train at all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch.checks.views import RunView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

__all__ = ["emit_never_stepped"]


def emit_never_stepped(check_id: str, view: RunView, log: FindingLog) -> None:
    """One error per optimizer that never stepped while its parameters got gradients."""
    for k, names in view.idle_optimizers:
        label = view.optimizer_name(k)
        log.emit(
            check_id,
            severity="error",
            step=max(view.steps - 1, 0),
            message=f"{label} never stepped although {len(names)} of its parameter(s) "
            f"received gradients, while the other watched optimizer(s) took {view.steps} "
            "step(s): its parameters never moved.",
            hint=f"Call {label}.step() after the backward pass that trains its model "
            "(a GAN's generator step forgotten?), or watch without it if it is unused.",
            params=names,
            key=f"optimizer[{k}]:never_stepped",
            details={
                "cause": "never_stepped",
                "optimizer": k,
                "optimizer_name": label,
                "params": len(names),
            },
        )
