"""``autocast_bypassed``: mixed precision silently not applied to some matmul-type layers.

Inside ``torch.autocast`` every linear and convolution layer computes in the autocast dtype.
One that produces float32 while its peers of the same kind produce bf16/fp16 escaped it: a
hand-written matmul autocast does not cover (a broadcast multiply-and-sum, a kernel without
an autocast rule), or a branch run in another thread (autocast is thread-local:
``nn.DataParallel`` replicas, a thread pool). It trains correctly, only slower and with more
memory, so nothing ever says so. The evidence (``autocast_dtypes``,
``gradwatch/capture/forward/autocast_probe.py``) is each layer's output dtype during the first
training steps: metadata, no sync.

Correct and silent: ``torch.autocast(enabled=False)`` around a layer, a custom function with
``torch.amp.custom_fwd(cast_inputs=torch.float32)``, and runs without autocast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.eval_mode import params_under
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog

_FULL = ("float32", "float64")
_CAUSE = {
    "thread": "it ran in another thread, where autocast (thread-local) was off",
    "op": "autocast was on around it, but its computation is not one autocast casts",
}


class AutocastBypassedConfig(CheckConfig):
    """``autocast_bypassed``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


class AutocastBypassed(Check):
    """One finding for the layers that escaped autocast while their peers did not."""

    id = "autocast_bypassed"
    maturity = "stable"
    Config = AutocastBypassedConfig
    needs = frozenset({"autocast_dtypes"})
    doc = CheckDoc(
        summary="Inside an enabled autocast region, a linear/conv layer produced float32 while "
        "its peers of the same kind produced the autocast dtype: mixed precision was not "
        "applied there.",
        why="Those layers run in full precision: slower and with more activation memory than "
        "you configured, and nothing fails.",
        causes=(
            "A hand-written matmul that autocast does not cover (a broadcast multiply and "
            "sum), or a custom kernel without an autocast rule.",
            "A branch run in another thread (`nn.DataParallel` replicas, a thread pool): "
            "autocast is thread-local, so it is off there.",
        ),
        fix="Compute the layer with an op autocast covers (`F.linear`, `torch.matmul`), "
        "register an autocast rule for the custom op (`torch.library.register_autocast`), "
        "or enter `torch.autocast` inside the thread (decorate the branch's forward).",
        silence=(
            "Keep a layer in float32 on purpose: `with torch.autocast(device, enabled=False)` "
            "around it, or `torch.amp.custom_fwd(cast_inputs=torch.float32)`.",
        ),
        detail="inside an enabled `torch.autocast` region, a linear/conv layer produced float32 "
        "while its peers of the same kind produced the autocast dtype: a hand-written matmul "
        "autocast does not cover (`details.cause: op`), or a branch run in another thread, where "
        "autocast (thread-local) is off (`thread`). Read from output dtypes during the first 3 "
        "training steps (metadata, no sync). `autocast(enabled=False)` around a layer and "
        "`custom_fwd(cast_inputs=torch.float32)` are fine. `details.modules`, `details.dtype`, "
        "`details.autocast_dtype`",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        seen: dict[str, Any] = view.window.autocast
        if not seen or view.optimizer is None:
            return
        applied = {r.kind for r in seen.values() if not r.escaped}
        escaped = {
            n: r for n, r in seen.items() if r.escaped and r.kind in applied and r.dtype in _FULL
        }
        if not escaped:
            return
        names = list(escaped)
        first = escaped[names[0]]
        shown = ", ".join(f"'{n}'" for n in names[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else ""
        )
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{len(names)} {first.kind} layer(s) ({shown}) produced {first.dtype} inside "
            f"an autocast region where their peers produced {first.autocast_dtype}: "
            f"{_CAUSE[first.escaped]}.",
            hint="Use an op autocast casts (F.linear, torch.matmul) or register an autocast "
            "rule for the custom op; for a thread, enter torch.autocast inside it. To keep a "
            "layer in float32 on purpose, disable autocast around it explicitly.",
            params=params_under(view.index, names),
            module=names[0],
            key="autocast",
            details={
                "modules": names,
                "dtype": first.dtype,
                "autocast_dtype": first.autocast_dtype,
                "cause": first.escaped,
            },
        )
