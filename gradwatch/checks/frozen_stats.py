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
``FrozenBatchNorm2d``, norm layers without affine parameters, and trainable ones. Also a
target the program moves itself (BYOL's and MoCo's EMA/momentum encoder, a mean teacher, a
target network synced every k steps): its parameters do not require grad, but they take new
values, and its batch norms run in train mode by design. The evidence is the values
(``gradwatch/capture/forward/_frozen_affine.py``): a flagged layer is held back at its first
flagged step and reported once a later step finds its affine values unchanged; one whose
values moved while still frozen is never reported, and a finding made before the move (a
target synced every k steps looks frozen until its first sync) is revised to ``info``
naming the design.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradwatch._severity import Severity
from gradwatch.checks.base import Check, CheckConfig, severity_field
from gradwatch.checks.docs import CheckDoc
from gradwatch.checks.eval_mode import params_under
from gradwatch.checks.views import StepView

if TYPE_CHECKING:
    from gradwatch.checks.base import FindingLog


_KEY = "frozen_norms"  # the one finding of all the layers
_HINT = (
    "Keep them in eval: override train() (`super().train(mode)`, then `m.eval()` for each "
    "frozen norm layer) or use torchvision.ops.FrozenBatchNorm2d."
)


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
        "The evidence that a layer is frozen is its values: its affine weight and bias are "
        "kept at its first flagged step and compared at the next four, then at the 8th, "
        "16th, 32nd ... flagging, so it is reported from its second flagged step, once "
        "found unchanged. A layer whose values moved while still `requires_grad=False` is "
        "moved by the program itself (an EMA/momentum target: BYOL, MoCo, mean teacher; a "
        "target network synced every k steps) and runs in train mode by design: never "
        "reported, and a finding made before its first move is revised to `info` "
        "(`details.program_updated`)",
    )

    def on_step(self, view: StepView, log: FindingLog) -> None:
        snap = view.window.modes
        if snap is None or view.optimizer is None or not view.backward_in_window:
            return
        if snap.program_updated:
            self._revise(snap.program_updated, log)
        names = snap.frozen_norms_training
        if not names:
            return
        log.emit(
            self.id,
            severity=self.severity,
            step=view.step,
            message=_frozen_message(names),
            hint=_HINT,
            params=params_under(view.index, list(names)),
            module=_common_parent(names),
            key=_KEY,
            details={"modules": list(names)},
        )

    def _revise(self, updated: tuple[str, ...], log: FindingLog) -> None:
        """Layers reported as frozen that the program moved since (a target synced every k
        steps looks frozen until its first sync): the finding names only those still
        unmoved, and is ``info`` once none is left."""
        finding = log.get(self.id, _KEY)
        if finding is None or finding.severity == "info":
            return
        modules = list(finding.details.get("modules", ()))
        left = [n for n in modules if n not in updated]
        if left == modules:
            return
        details = {"modules": left, "program_updated": [n for n in modules if n not in left]}
        if left:
            log.revise(
                self.id,
                _KEY,
                severity=finding.severity,
                message=_frozen_message(tuple(left)),
                hint=finding.hint,
                details=details,
            )
            return
        log.revise(
            self.id,
            _KEY,
            severity="info",
            message=f"{len(modules)} normalisation layer(s) with requires_grad=False affine "
            f"parameters ({_shown(modules)}) run in train mode, but the program itself changes "
            "their values (an EMA/momentum target or a target network synced every few "
            "steps): not frozen, their running statistics are theirs to update.",
            hint="Nothing to do if this is a target/teacher network updated by the program.",
            details=details,
        )


def _shown(names: Sequence[str]) -> str:
    """The first three names quoted, and how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(f"'{n}'" for n in names[:3]) + more


def _frozen_message(names: Sequence[str]) -> str:
    return (
        f"{len(names)} normalisation layer(s) with frozen affine parameters ({_shown(names)}) "
        "ran training steps in train mode: their running statistics changed although the "
        "layers are meant to be frozen."
    )
