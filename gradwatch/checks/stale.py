"""``stale_param``: finite non-zero gradients, yet none of a layer's values changed in the step."""

from __future__ import annotations

from math import inf
from typing import TYPE_CHECKING, Any, Optional

import torch
from pydantic import Field, StrictInt

from gradwatch._severity import Severity
from gradwatch.checks._grouping import numel_of
from gradwatch.checks._never_stepped import emit_never_stepped
from gradwatch.checks._patience import Streaks
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.views import LayerSample, LayerTable, RunView, StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


class StaleParamConfig(CheckConfig):
    """``stale_param``: finite non-zero gradients, yet the layer's values did not change."""

    severity: Severity = severity_field("warning")
    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )
    precision_moved: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description="bf16/fp16 layers: updates round away (`cause: precision`) when fewer "
        "than this share of the values that had a non-zero gradient changed in the step.",
    )


class StaleParam(Check):
    """Per layer, on observed optimizer steps (needs the values before and after the step)."""

    id = "stale_param"
    maturity = "stable"
    Config = StaleParamConfig
    counts_toward_share = True
    doc = CheckDoc(
        summary="A layer had finite non-zero gradients, yet none of its values changed across "
        "the step, for patience observed steps.",
        why="Gradients are computed and thrown away: the layer silently does not train.",
        causes=(
            "Learning rate 0 in its param group (a scheduler at 0, a typo).",
            "The optimizer holds copies of the parameters, not the model's own tensors.",
            "A step skipped by custom code.",
            "Its optimizer never stepped while another watched optimizer did (one of a "
            "GAN's two `step()` calls forgotten): `cause: never_stepped`, an error.",
            "bf16/fp16 weights whose updates are below the resolution of their dtype "
            "(`cause: precision`): `w + lr * update` rounds back to `w` for nearly every "
            "element (pure bf16 training at a small learning rate).",
        ),
        fix="Check its param group's learning rate and that the optimizer holds the model's "
        "parameters (build it after the model is moved and complete). For `cause: "
        "precision`, keep float32 master weights (`torch.autocast` computes in bf16 without "
        "bf16 weights) or use an optimizer with Kahan summation or stochastic rounding.",
        detail="finite non-zero gradients, yet the layer's values did not change across the step "
        "(lr 0: `details.cause: lr_zero`; wrong group), or, for bf16/fp16 weights, fewer than "
        "`precision_moved` (10 %) of the values with a gradient changed: the updates round away "
        "(`details.cause: precision`, `details.dtype`, `details.moved_fraction`, from the "
        "fingerprint's sample). fp32 master weights under autocast and optimizers with Kahan "
        "summation or stochastic rounding are fine. An optimizer that never steps while another "
        "watched one does, although its parameters get gradients (one of a GAN's two `step()` "
        "calls forgotten): `details.cause: never_stepped`, an error. A param group at lr 0 is one "
        "finding naming the group (`details.group`), with every parameter of it",
    )
    config: StaleParamConfig

    def __init__(self, config, watch_config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, watch_config)
        self._streaks = Streaks()

    def on_step(self, view: StepView, log: FindingLog) -> None:
        if view.optimizer is None:
            return
        layers, limit = view.layers, self.config.precision_moved
        # A layer's moved share is a mean of its parameters': with none below the limit no
        # layer rounds its update away, and the usual step makes no call per layer.
        frac = view.moved_frac
        low = frac is not None and min((f for f in frac if f is not None), default=1.0) < limit
        stale: dict[str, Optional[float]] = {}  # layer -> moved share (precision) or None
        if low:
            for layer, s in layers.items():
                moved = _rounded_away(view, s, limit) if _judged(s) else None
                if moved is not None or (s.delta_norm == 0.0 and 0 < s.norm < inf):
                    stale[layer] = moved
        elif 0.0 in LayerTable.of(layers).delta_norm:  # a C-level scan: None is not 0.0
            stale = {
                layer: None
                for layer, s in layers.items()
                if s.delta_norm == 0.0 and 0 < s.norm < inf
            }
        streaks = self._streaks.advance(stale, lambda layer: _judged(layers.get(layer)))
        grouped: dict[tuple[Optional[int], str], list[tuple[str, list[int], dict[str, Any]]]] = {}
        for layer, moved in stale.items():
            if streaks[layer] < self.config.patience:
                continue
            s = layers[layer]
            ids = [view.ids[k] for k in s.positions]
            details: dict[str, Any] = {"grad_norm": s.norm}
            if all(view.group_lr(i) == 0.0 for i in ids):
                details.update(cause="lr_zero", lr=0.0)
            elif moved is not None:
                details.update(cause="precision", dtype=_low_precision(view, ids))
                details["moved_fraction"] = moved
            cause = str(details.get("cause", "unchanged"))
            grouped.setdefault((view.group_of(ids[0]), cause), []).append((layer, ids, details))
        for (g, cause), rows in grouped.items():
            self._emit(view, g, cause, rows, log)

    def _emit(
        self,
        view: StepView,
        g: Optional[int],
        cause: str,
        rows: list[tuple[str, list[int], dict[str, Any]]],
        log: FindingLog,
    ) -> None:
        """One finding per param group and cause: the group at lr 0 with every parameter of
        it that had a gradient, or the layers of one group stale for one other reason."""
        opt = f"optimizer[{view.optimizer}]"
        group = f"{opt}.group[{g}]" if g is not None else opt
        ids = [i for _, layer_ids, _ in rows for i in layer_ids]
        if cause == "lr_zero":  # the whole group: its other parameters do not move either
            got = set(ids) | {i for i in view.group_ids(g) if view.received(i)}
            ids = [i for i in view.group_ids(g) if i in got] or ids
        layers = list(dict.fromkeys(view.index.params[i].layer for i in ids))
        details: dict[str, Any] = {"optimizer": view.optimizer, "numel": numel_of(view.index, ids)}
        for _, _, extra in rows:
            details.update({k: v for k, v in extra.items() if k not in details})
        details["grad_norm"] = max(float(r[2]["grad_norm"]) for r in rows)
        if g is not None:
            details["group"] = g
        single = len(layers) == 1
        if not single:
            details["layers"] = layers
        said, hint = "", _HINT
        if cause == "lr_zero":
            said, hint = " Its param group's learning rate is 0.", _HINT_LR_ZERO
        elif cause == "precision":
            moved = min(float(r[2]["moved_fraction"]) for r in rows)
            said = (
                f" Its {details.get('dtype')} weights round the updates away: {moved:.1%} of "
                "the values with a gradient changed."
            )
            hint = _HINT_PRECISION
        unchanged = "barely changed" if cause == "precision" else "did not change"
        patience = self.config.patience
        if cause == "lr_zero":
            message = (
                f"param group {group} has learning rate 0: its {len(ids)} parameter(s) in "
                f"{len(layers)} layer(s) had gradients but did not change across "
                f"{opt}.step() for {patience}+ observed steps."
            )
        elif single:
            message = (
                f"layer '{layers[0]}': had gradients but its values {unchanged} across "
                f"{opt}.step() for {patience}+ observed steps.{said}"
            )
        else:
            message = (
                f"{len(layers)} layers of {group}: had gradients but their values {unchanged} "
                f"across {opt}.step() for {patience}+ observed steps.{said}"
            )
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=message,
            hint=hint,
            params=view.index.names(ids),
            module=layers[0] if single else None,
            details=details,
            # stable as more layers of the group reach patience
            key=group if cause == "lr_zero" else f"{group}:{cause}",
        )

    def on_run(self, view: RunView, log: FindingLog) -> None:
        emit_never_stepped(self.id, view, log)  # an optimizer forgotten (error)


_LOW = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _low_precision(view: StepView, ids: list[int]) -> Optional[str]:
    """The layer's dtype when all its parameters are bf16/fp16, else ``None``."""
    found = None
    for i in ids:
        p = view.index.params[i].ref()
        if p is None or p.dtype not in _LOW:
            return None
        found = _LOW[p.dtype]
    return found


def _judged(s: Optional[LayerSample]) -> bool:
    """Whether the step judged a layer: an update measured, finite non-zero gradients."""
    return s is not None and s.delta_norm is not None and 0 < s.norm < inf


def _rounded_away(view: StepView, s: LayerSample, limit: float) -> Optional[float]:
    """The share of the layer's gradient-carrying values that changed, when bf16/fp16
    rounding lost nearly all of its update (below ``limit`` of them moved); else ``None``."""
    frac = view.moved_frac
    if frac is None or not s.numel or not s.nonzero or not s.positions:
        return None
    first = view.index.params[view.ids[s.positions[0]]].ref()
    if first is None or first.dtype not in _LOW:  # not every one bf16/fp16 (checked below)
        return None
    parts = [(frac[k], view.numel[k]) for k in s.positions if k < len(frac)]
    known = [(f, n) for f, n in parts if f is not None]
    if not known or len(known) < len(parts):
        return None
    moved = sum(f * n for f, n in known) / (sum(n for _, n in known) or 1)
    with_grad = s.nonzero / s.numel  # rows without a gradient (embeddings) need not move
    if moved >= limit * with_grad:
        return None
    ids = [view.ids[k] for k in s.positions]
    if _low_precision(view, ids) is None or any(view.compensated(i) for i in ids):
        return None
    if any((view.group_lr(i) or 0.0) <= 0.0 for i in ids):
        return None  # lr 0 is its own cause
    return moved


_HINT_PRECISION = (
    "Updates smaller than half a unit in the last place of a bf16/fp16 weight are lost. "
    "Keep float32 master weights and compute in low precision with torch.autocast, use an "
    "optimizer with Kahan summation or stochastic rounding, or raise the learning rate."
)
_HINT = (
    "Check its param group's learning rate (0?), that the optimizer holds these exact tensors "
    "(re-created after .to()?), and any skipped or masked update."
)
_HINT_LR_ZERO = (
    "A learning rate of 0 trains nothing: check the group's 'lr' and the scheduler (a warm-up "
    "held at 0, a decay to 0). To keep them fixed on purpose, set requires_grad=False on them."
)
