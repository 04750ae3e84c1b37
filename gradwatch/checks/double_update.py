"""``double_update``: one gradient consumed by more than one optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import StepView, StructureView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class DoubleUpdateConfig(CheckConfig):
    """``double_update``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("error")


class DoubleUpdate(Check):
    """A gradient applied twice: two steps consumed it with no backward in between.

    Meaning: a parameter's gradient, unchanged since its last accumulation, was consumed by
    an optimizer step that came after another step had already consumed it.

    Causes: a parameter held by two optimizers that both step after one backward (a shared
    encoder in an RL actor/critic or contrastive setup); ``step()`` called twice for one
    backward (a helper that steps, plus the caller's own step).

    Fix: give each parameter to exactly one optimizer (or step the shared one once), and
    call ``step()`` once per backward.

    Judged from what each step consumed (the event number of the gradient's last
    accumulation against the one a previous step consumed), not from the layout: a
    parameter in two optimizers used in different phases is fine, and so is a zeroed
    gradient (it carries no update) or one replaced by hand.
    """

    id = "double_update"
    maturity = "stable"
    Config = DoubleUpdateConfig
    doc = CheckDoc(
        summary="One gradient was consumed by more than one optimizer step with no backward in "
        "between.",
        why="The parameter moves twice (or at double the learning rate, with momentum twice "
        "advanced) for one batch: training diverges or behaves unlike the configuration.",
        causes=(
            "A parameter sits in two optimizers that both step (a shared embedding given to a "
            "generator's and a discriminator's optimizer).",
            "`optimizer.step()` called twice for one `backward()` (once in the loop, once in a "
            "helper or callback).",
        ),
        fix="Give every parameter to exactly one optimizer and call `step()` once per "
        "`backward()`; `details.optimizers` lists the optimizers involved.",
        detail="one gradient consumed by two optimizer steps with no backward in between: a "
        "parameter in two optimizers that both step (shared encoder), or `step()` twice per "
        "backward. Judged from what each step consumed, so a parameter shared by optimizers used "
        "in different phases is fine. `details.optimizers`: index and class",
    )

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._shared: set[int] = set()
        self._classes: list[str] = []
        # shared parameter -> (accumulation event a step consumed, that optimizer)
        self._consumed: dict[int, tuple[int, int]] = {}

    def on_structure(self, view: StructureView, log: FindingLog) -> None:
        self._shared = {i for i, ks in view.optimizer_of.items() if len(set(ks)) > 1}
        self._classes = list(view.extra.get("optimizer_classes", []))

    def _class(self, k: int) -> str:
        return self._classes[k] if k < len(self._classes) else "Optimizer"

    def on_step(self, view: StepView, log: FindingLog) -> None:
        k = view.optimizer
        state = view.window.acc_state
        if k is None or state is None or not view.ids:
            return
        # (parameter, optimizer that consumed the same gradient before)
        doubled: list[tuple[int, int]] = []
        if not any(view.arrived):
            # Nothing new since this optimizer's previous step: a non-zero gradient still
            # left from that step's backward is being applied a second time.
            for j, i in enumerate(view.ids):
                if self._kept(view, j, i, state):
                    doubled.append((i, k))
        if self._shared:
            for j, i in enumerate(view.ids):
                if i not in self._shared:
                    continue
                seq, _ = state(i)
                prev = self._consumed.get(i)
                if (
                    prev is not None
                    and prev[0] == seq
                    and prev[1] != k
                    and seq > 0
                    and self._kept(view, j, i, state, fresh_ok=True)
                ):
                    doubled.append((i, prev[1]))
                if view.has_grad[j]:
                    self._consumed[i] = (seq, k)
        if doubled:
            self._emit(view, log, k, doubled)

    @staticmethod
    def _kept(
        view: StepView,
        j: int,
        i: int,
        state: object,
        fresh_ok: bool = False,
    ) -> bool:
        """Param ``i`` holds a non-zero gradient that is the tensor its last accumulation left."""
        norm: Optional[float] = view.grad_norm[j]
        if not view.has_grad[j] or not norm:
            return False
        seq, acc = state(i)  # type: ignore[operator]
        if seq <= 0 or (view.arrived[j] and not fresh_ok):
            return False
        p = view.index.params[i].ref()
        return p is not None and p.grad is not None and p.grad is acc

    def _emit(
        self, view: StepView, log: FindingLog, k: int, doubled: list[tuple[int, int]]
    ) -> None:
        ids = list(dict.fromkeys(i for i, _ in doubled))
        others = sorted({o for _, o in doubled})
        names = view.index.names(ids)
        optimizers = sorted({k, *others})
        label = view.index.optimizer_label
        if others == [k]:
            what = f"{label(k)}.step() ran again with no backward since its previous step"
            hint = (
                "step() is called twice per backward (e.g. a helper that steps plus the "
                "caller's own step): keep one optimizer.step() per backward()."
            )
        else:
            what = (
                f"{label(k)}.step() applied gradients that "
                + ", ".join(label(o) for o in others if o != k)
                + " already applied"
            )
            hint = (
                "These parameters sit in several optimizers that all step after one backward: "
                "give each parameter to exactly one optimizer (e.g. exclude the shared encoder "
                "from one of them), or zero its gradient after the first step."
            )
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{what}: {len(names)} parameter(s) updated twice by one gradient.",
            hint=hint,
            params=names,
            key="optimizers " + ",".join(map(str, optimizers)),
            details={"optimizers": [{"index": o, "class": self._class(o)} for o in optimizers]},
        )
