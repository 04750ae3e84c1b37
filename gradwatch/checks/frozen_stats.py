"""``frozen_stats_updated``: a frozen normalisation layer's running statistics keep moving.

Fine-tuning with a frozen backbone (detection, segmentation, linear probes) freezes the
batch-norm parameters with ``requires_grad_(False)``, but ``model.train()`` puts those layers
back in training mode, where every forward updates ``running_mean``/``running_var`` from the
current (often tiny) batches: the "frozen" backbone drifts, and eval results change. The
evidence (``module_modes``, ``gradwatch/capture/forward/modes.py``) is, for the norm layers whose
affine parameters are all frozen, whether their statistics moved in the step: a batch
norm's ``num_batches_tracked`` counts its train-mode calls, so a forward that puts a frozen
sub-network in eval itself (a perceptual-loss network) is judged by what happened, not by
the mode at its start. An instance norm (no such counter) is judged by its mode then.

Correct and silent: frozen norm layers kept in eval (a ``train()`` override, ``norm_eval``),
``FrozenBatchNorm2d``, norm layers without affine parameters, and trainable ones. Also an
EMA or momentum target (BYOL, MoCo, a mean teacher): its parameters do not require grad, but
the program moves them every step, and its batch norms run in train mode by design. The
evidence is their values: a flagged layer is reported only once a later step finds its
affine values unchanged (so from the second flagged step on), and one whose values moved is
never reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.eval_mode import params_under
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


def _common_parent(names: tuple[str, ...]) -> str:
    """The deepest module holding every one of ``names`` (``backbone`` for ``backbone.1``,
    ``backbone.4``); a single name is itself."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or "(root)"


class FrozenStatsUpdatedConfig(CheckConfig):
    """``frozen_stats_updated``: no thresholds (``enabled`` and ``severity`` only)."""

    severity: Severity = severity_field("warning")


class FrozenStatsUpdated(Check):
    """One finding for all the frozen norm layers a step's training forward ran in train mode."""

    id = "frozen_stats_updated"
    maturity = "stable"
    Config = FrozenStatsUpdatedConfig
    needs = frozenset({"module_modes"})
    doc = CheckDoc(
        summary="A normalisation layer whose affine parameters are all frozen ran training "
        "steps in train mode: its running statistics changed.",
        why="Freezing a batch-norm layer's weight and bias does not freeze its running mean "
        "and variance: in train mode every forward updates them from the current batch "
        "(often a handful of images), so a frozen backbone drifts and evaluation changes.",
        causes=(
            "`model.train()` (by the loop, Lightning or the HF Trainer) switches the frozen "
            "backbone's batch norms back to training mode.",
            "Only the parameters were frozen (`requires_grad_(False)`), the layers never put "
            "in eval.",
        ),
        fix="Keep frozen norm layers in eval: override `train()` to call `super().train(mode)` "
        "then `.eval()` on them, or replace them with `torchvision.ops.FrozenBatchNorm2d`.",
        detail="normalisation layers whose affine parameters are all frozen ran training steps in "
        "train mode, so their running statistics moved (a frozen backbone after `model.train()`, "
        "by the loop, Lightning or the HF Trainer). One finding for all of them; `details.modules`. "
        "Reported from the second flagged step, once the layer's affine values are found "
        "unchanged: an EMA/momentum target (BYOL, MoCo, mean teacher), whose frozen-looking "
        "parameters the program moves every step, is not frozen and not reported",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        snap = view.window.modes
        if snap is None or view.optimizer is None or not view.backward_in_window:
            return
        names = snap.frozen_norms_training
        if not names:
            return
        module = _common_parent(names)
        shown = ", ".join(f"'{n}'" for n in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=f"{len(names)} normalisation layer(s) with frozen affine parameters "
            f"({shown}{more}) ran training steps in train mode: their running statistics "
            "changed although the layers are meant to be frozen.",
            hint="Keep them in eval: override train() (`super().train(mode)`, then "
            "`m.eval()` for each frozen norm layer) or use torchvision.ops.FrozenBatchNorm2d.",
            params=params_under(view.index, list(names)),
            module=module,
            key="frozen_norms",
            details={"modules": list(names)},
        )
